"""The checkpoint's code at both ends of the transformers range it names (`compat.TESTED_TRANSFORMERS`): a tiny MARS
checkpoint saved here is loaded and decoded by `remote_code_check.py` under this environment's transformers (the
newest) and under the oldest, in a venv of its own that has no hf_mars (`.ci/run` makes it and sets
HF_MARS_OLDEST_PYTHON)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from helpers import make_model, make_tokenizer, venv_python

import hf_mars
from hf_mars.decoding import compat
from hf_mars.hub import portable_tokenizer_config

CHECK = Path(__file__).with_name("remote_code_check.py")
OLDEST = compat.TESTED_TRANSFORMERS[0]
INSTALL = (
    f"python3 -m venv VENV && VENV/bin/pip install torch==2.13.0 transformers=={OLDEST} safetensors, "
    "then HF_MARS_OLDEST_PYTHON=VENV/bin/python"
)


def oldest_python() -> str:
    return venv_python("HF_MARS_OLDEST_PYTHON", "the oldest transformers", INSTALL)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("range")
    tok, model = make_tokenizer(), make_model("llama", rope_theta=5e5)  # not the default base: read, not assumed
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # confidences spread over (0, 1): τ = 0.6 accepts several tokens some passes
    hf_mars.to_mars(model, tok, block_size=4)
    model.save_pretrained(folder / "mars-llama")
    tok.save_pretrained(folder / "mars-llama")
    config = folder / "mars-llama" / "tokenizer_config.json"
    config.write_bytes(portable_tokenizer_config(config) or config.read_bytes())  # as `hf-mars push` uploads it
    prompts = ["hello world, how", "a", "the quick brown fox jumps"]
    enc = tok(prompts, return_tensors="pt", padding=True)
    inputs = {k: v.tolist() for k, v in enc.items()} | {"rope_theta": 5e5, "prompts": prompts}
    (folder / "inputs.json").write_text(json.dumps(inputs))
    return folder / "mars-llama", folder / "inputs.json"


@pytest.mark.parametrize("end", ["newest", "oldest"])
def test_checkpoint_code_decodes_exactly_at_both_ends_of_the_range(checkpoint, end):
    python = sys.executable if end == "newest" else oldest_python()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    result = subprocess.run(
        [python, "-I", str(CHECK), *map(str, checkpoint)], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    version = transformers.__version__ if end == "newest" else OLDEST
    assert f"transformers {version}: loaded MARSLlamaForCausalLM" in result.stdout
    assert "FAILED" not in result.stdout and result.stdout.count("ok ") == 15


class Lines(logging.Handler):
    """The messages logged to one logger (whatever other tests did to propagation or verbosity)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_an_untested_release_is_named_once_in_one_line(monkeypatch):
    logger, caught = logging.getLogger(compat.__name__), Lines()
    logger.addHandler(caught)
    monkeypatch.setattr(logger, "disabled", False)
    monkeypatch.setattr(logger, "level", logging.WARNING)
    monkeypatch.setattr(logger, "_cache", {})  # what an earlier test's level made it answer (`isEnabledFor`)
    monkeypatch.setattr(logger.manager, "disable", logging.NOTSET)  # a library's `logging.disable` in an earlier test
    try:
        compat.warn_if_untested.cache_clear()
        monkeypatch.setattr(transformers, "__version__", "9.1.0")
        compat.warn_if_untested()
        compat.warn_if_untested()
        assert caught.lines == [
            f"MARS decoding was tested with transformers {OLDEST} to {compat.TESTED_TRANSFORMERS[-1]}; this is 9.1.0."
        ]
        compat.warn_if_untested.cache_clear()
        monkeypatch.setattr(transformers, "__version__", compat.TESTED_TRANSFORMERS[-1])
        compat.warn_if_untested()
        assert len(caught.lines) == 1
    finally:
        logger.removeHandler(caught)
        compat.warn_if_untested.cache_clear()
