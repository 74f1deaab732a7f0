"""Serving the Space (spaces_demo/app.py) for tests: a tiny checkpoint, a free local port, forward passes slowed so
that a generation lasts long enough to be steered."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import time
from pathlib import Path

import torch
from helpers import make_model, make_tokenizer

import hf_mars

SPACE = Path(__file__).resolve().parents[2] / "spaces_demo"
PASS_SECONDS = 0.01  # each forward pass sleeps this long, so that a generation lasts long enough to be steered


def load_app():
    spec = importlib.util.spec_from_file_location("mars_space_app", SPACE / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def save_checkpoint(path: Path) -> Path:
    """A tiny MARS checkpoint whose sharpened head spreads confidences, so that τ ≈ 0.5 accepts several tokens."""
    tok, model = make_tokenizer(), make_model("qwen2")
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    hf_mars.to_mars(model, tok, block_size=4)
    model.generation_config.mars_lossless = dict(mars_block_size=2, mars_draft_candidates=3, mars_lookup=4)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_app(tmp_dir: Path, pass_seconds: float = PASS_SECONDS):
    """The app as `main()` builds it, loaded through MARS_MODEL, served on a free local port; yields (app, url, calls)
    where `calls` counts forward passes of the shared model."""
    app = load_app()
    env = dict(MARS_MODEL=str(save_checkpoint(tmp_dir / "ckpt")), MARS_DTYPE="float32")  # lossless: AR's very text
    old = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        model, tokenizer = app.load_model()
    finally:
        for name, value in old.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)
    calls = [0]

    def slow(*_):
        calls[0] += 1
        time.sleep(pass_seconds)

    model.register_forward_pre_hook(slow)
    demo = app.build_demo(model, tokenizer)
    port = free_port()
    app.serve(demo, server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield app, f"http://127.0.0.1:{port}/", calls
    finally:
        demo.close()
