"""Builders the tests share (tiny models, a tokenizer, toy prompts), all made offline. Tests import these; fixtures
live in conftest.py. No test module imports another."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import psutil  # an accelerate dependency
import pytest
import torch
from transformers import StoppingCriteria
from transformers.generation.streamers import BaseStreamer

import hf_mars
from hf_mars.decoding.ordered_linear import OrderedLinear
from hf_mars.tools.checkpoints.toy import counting_dataset, toy_model, toy_tokenizer


def make_tokenizer():
    return toy_tokenizer()


def make_model(family: str = "qwen2", vocab_size: int = 272, seed: int = 0, dtype=torch.float32, **overrides):
    """A 2-layer `family` model; initializer_range 0.2 gives peaked distributions: confidences spread over (0, 1)."""
    overrides.setdefault("initializer_range", 0.2)
    return toy_model(family, vocab_size=vocab_size, seed=seed, dtype=dtype, **overrides)


def toy_prompts(tok, n=8, seed=4321):
    test = counting_dataset(n, seed=seed)
    prompts = [tok.apply_chat_template(ex["messages"][:1], add_generation_prompt=True, tokenize=False) for ex in test]
    return tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)


class StopRowAfterCalls(StoppingCriteria):
    """Stateful and per row: row i stops at its `limits[i]`-th call, whatever the tokens (a call is a step). Records
    every tensor it is shown."""

    def __init__(self, limits):
        self.limits, self.calls, self.seen = torch.tensor(limits), 0, []

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        self.seen.append(input_ids.clone())
        return torch.full((input_ids.shape[0],), self.calls) >= self.limits


class Recorder(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.view(-1).tolist())

    def end(self):
        self.ended = True


def run_launched(command: list[str], timeout: float) -> tuple[int, str]:
    """Run a launcher command (`accelerate launch`, torchrun) on one thread per process: (return code, stderr).
    On a timeout the whole process tree is killed: torchrun starts each worker in a session of its own, and workers
    left behind would wait on the dead launcher's rendezvous and hold the output pipes open."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for child in [*psutil.Process(process.pid).children(recursive=True), psutil.Process(process.pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        process.communicate()
        raise
    return process.returncode, stderr


@contextlib.contextmanager
def serving(app):
    """`app` on a free loopback port in a background thread, for the block: yields its base URL."""
    import socket
    import threading
    import time

    import uvicorn

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def venv_python(variable: str, what: str, install: str) -> str:
    """The Python of a venv of its own that a test needs (`.ci/run` makes it and sets `variable`): in CI a missing one
    fails the test, elsewhere it skips it, naming the line that makes it."""
    python = os.environ.get(variable)
    if not python:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs {what}: {variable} is unset ({install})")
        pytest.skip(f"{what} needs a venv of its own: {install}")
    return python


def auto_lossless_model(acceptance: dict | None = None):
    """A tiny Llama made MARS (B = 4) whose lossless mode is `"auto"`, with these trees' tokens per forward."""
    tok = make_tokenizer()
    model = hf_mars.to_mars(make_model("llama"), tok, block_size=4)
    model.generation_config.mars_acceptance = acceptance or {"2x3": 1.6, "4x3+8": 2.9}
    model.generation_config.mars_lossless = "auto"
    return model, tok


def _slides(window, *kinds):
    return [kind if window or kind == "full_attention" else "full_attention" for kind in kinds]


SLIDING = {  # a window of 8 (None: the same model without one); hybrid Gemma 3 and Qwen2, all-sliding Mistral
    "mistral": lambda window: dict(sliding_window=window),
    "gemma3": lambda window: dict(
        sliding_window=8, layer_types=_slides(window, "sliding_attention", "full_attention"), head_dim=16
    ),
    "qwen2": lambda window: dict(
        use_sliding_window=bool(window),
        sliding_window=window,
        max_window_layers=1,
        layer_types=_slides(window, "full_attention", "sliding_attention"),
    ),
}


def sliding_mars_model(family, attention="sdpa", window=8):
    """A MARS model (B = 4) of `family` whose sliding layers see `window` positions, and its tokenizer."""
    tok = make_tokenizer()
    model = make_model(family, eos_token_id=None, **SLIDING[family](window))
    model.set_attn_implementation(attention)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return hf_mars.to_mars(model, tok, block_size=4), tok


def rows_invariant_linear(dtype) -> bool:
    """Whether an `ordered` model's linear layers (`OrderedLinear`) give a row the same bits at 1 and at 2 to 24 rows
    in `dtype` on this CPU: the premise, beside the attention, of a model's token being the same in a wide pass (true
    on the AVX2 CPU of docs/benchmarks.md in bfloat16 and float32; plain float32 products are not)."""
    numbers = torch.Generator().manual_seed(2)  # not the global generator: the caller's seeds stay as they were
    layer = OrderedLinear(64, 96, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, 64, generator=numbers))
        layer.to(dtype)
        x = torch.randn(24, 64, generator=numbers).to(dtype)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(24)])
        return all(torch.equal(layer(x[:rows]), alone[:rows]) for rows in range(2, 25))


def decoding_caller(depth: int = 2) -> str:
    """`file:function` of the innermost hf_mars decoding frame on the stack (from `depth` frames up: a forward
    pre-hook's caller), or "elsewhere": which function ran a MARS pass."""
    frame = sys._getframe(depth)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/hf_mars/decoding/" in path:
            return f"{Path(path).name}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "elsewhere"
