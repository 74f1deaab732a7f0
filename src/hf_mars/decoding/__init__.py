"""MARS decoding: the code that ships inside every MARS checkpoint.

Every module in this folder except this one is copied into a checkpoint by `save_pretrained` (trust_remote_code) and
runs there without hf_mars installed, so the modules import torch, transformers and each other only, as
`from .name import X`: the one form transformers follows when it copies a class's files. `REMOTE_FILES` names them;
hub uploads, the shipped checkpoint's build stamp and the tests read it from here.
"""

from pathlib import Path

REMOTE_FILES = (
    "modeling.py",  # the MARS<Base> classes that a checkpoint's auto_map names
    "generate.py",  # MARSGenerationMixin.generate: the batch admitted into a runner, stepped until every row stops
    "session.py",  # Session: rows prepared as generate() prepares its batch, and their prompt's pass
    "graph.py",  # graph_pass: every MARS pass after a prompt's, one fixed-shape function of named phases
    "graph_state.py",  # GraphShape, GraphState, GraphPass: a pass's shape, rows state, tables; compiled or captured
    "runner.py",  # Runner: fixed rows over one graph pass and its static cache, rows joining (admit) and leaving
    "settings.py",  # MARSSettings: the validated mars_* arguments of one call
    "costs.py",  # mars_lossless="auto": this machine's pass costs, read (hf_mars's tools time them); the best tree
    "scoring.py",  # logits processors, token choice, confidence
    "schedule.py",  # MaskSchedule: how many masks each row is offered
    "cache.py",  # StaticMARSCache: the books of a prompt's pass over a static cache; compaction, views
    "tree.py",  # DraftTree: lossless mode's draft tree, its attention pattern, prompt lookup
    "verify.py",  # lossless mode: verification of drafts, proposal of the next ones
    "commit.py",  # what a pass keeps: the tokens each row takes (EOS, length), its text, the next pending tokens
    "stopping.py",  # stopping criteria called exactly as generate() calls them
    "ordered_attention.py",  # attention that adds key by key: a token's logits whatever the pass's shape
    "ordered_linear.py",  # linear layers in blocks of one row count where a machine's kernels round a row by its rows
    "compat.py",  # the transformers names that are not stable public API, each behind one function
)
REMOTE_DIR = Path(__file__).parent
