"""Tiny models and a tokenizer built offline (see `hf_mars.toy`), so every test runs without the Hub."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import make_tokenizer

# Tiny models gain nothing from threads, and on a shared 2-core machine OpenMP threads of concurrent jobs spin
# against each other (tests ran 30x slower). HF_MARS_TEST_THREADS overrides.
torch.set_num_threads(int(os.environ.get("HF_MARS_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def idle_machine(monkeypatch):
    """Timing pass costs declines on a machine that other work keeps busy (`cpu_load.py`), as a CI runner may be
    while these tests run: each test sees an idle machine unless it says otherwise (the tests of that behaviour), so
    that what it asserts does not depend on what else runs."""
    from hf_mars.tools.measure import passes

    monkeypatch.setattr(passes, "busy_cores", lambda threads=None: 0)
    monkeypatch.setattr(passes, "timing_share", lambda started: 1.0)


@pytest.fixture
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def trained_toy(tmp_path_factory):
    """A toy MARS model actually trained (200 MARSTrainer steps, ~1 CPU minute): its masks predict real tokens, so
    multi-token passes and draft acceptance are exercised, not just possible."""
    from hf_mars.tools.checkpoints.demo import train_toy

    return train_toy(steps=200, block_size=4, output_dir=tmp_path_factory.mktemp("toy"))
