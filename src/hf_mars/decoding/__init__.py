"""MARS decoding: the code that ships inside every MARS checkpoint.

Every module in this folder except this one is copied into a checkpoint by `save_pretrained` (trust_remote_code) and
runs there without hf_mars installed, so the modules import torch, transformers and each other only, as
`from .name import X`: the one form transformers follows when it copies a class's files. `REMOTE_FILES` names them;
hub uploads, the shipped checkpoint's build stamp and the tests read it from here.
"""

from pathlib import Path

REMOTE_FILES = ("modeling.py", "generate.py", "cache.py")
REMOTE_DIR = Path(__file__).parent
