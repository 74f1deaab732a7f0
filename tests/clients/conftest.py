"""The checkpoint real clients load: a tiny MARS model saved with its remote code, loaded back by path with
`trust_remote_code=True` exactly as lm-eval, `pipeline` and a streamer user would load a Hub checkpoint."""

from __future__ import annotations

import pytest
import torch
from helpers import make_model, make_tokenizer

import hf_mars


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Clients must not reach the Hub: everything they load lives in a temporary folder."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def client_checkpoint(tmp_path_factory):
    """A saved MARS checkpoint (block size 4) whose sharpened head spreads confidences, so that τ = 0.9 accepts
    several tokens in some passes while greedy decoding stays well defined."""
    path = tmp_path_factory.mktemp("clients") / "mars-toy"
    tok, model = make_tokenizer(), make_model("qwen2")
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    hf_mars.to_mars(model, tok, block_size=4)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
