"""`mars_lossless="auto"`: the draft tree with the most tokens per second on this machine, or none at all.

Two measurements meet here. What a tree earns, tokens per pass, belongs to the checkpoint: `hf-mars tune` measures it
once, on any machine, and stores it in the generation config as `mars_acceptance` (`{"BxN+L": tokens per forward}`).
What a pass costs belongs to the machine: the time of a forward over w tokens for this device, dtype, thread count,
batch size and architecture, measured here at first use (a few seconds) and cached per machine in
`$HF_MARS_CACHE/pass_costs.json` (default `~/.cache/hf_mars`). A tree runs only if it beats plain decoding, one
token per one-token pass, by `MARGIN`; otherwise the call is plain `generate()`, which lossless mode's output equals.
So lossless mode is never meaningfully slower than plain decoding in the same dtype, and wide trees run where a wide
pass is nearly free (a GPU at small batch, a CPU with native bfloat16 matrix units).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import re
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from .compat import CACHE_ARG, supports_logits_to_keep

logger = logging.getLogger(__name__)

# A tree must promise this much more than plain decoding: a bare forward's time leaves out the loop's host work per
# pass (choosing, verifying, cache bookkeeping), which plain decoding pays less of
MARGIN = 1.1
_TREE = re.compile(r"^(\d+)x(\d+)(?:\+(\d+))?$")
# What a pass's cost depends on in a model's config: its shape, not its weights
_SHAPE_KEYS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
)


def parse_tree(name: str) -> tuple[int, int, int]:
    """`"BxN"` or `"BxN+L"` -> `(B, N, L)`: block size, candidates for the first draft, prompt-lookup drafts."""
    match = _TREE.match(str(name))
    if match is None or int(match[1]) < 2 or int(match[2]) < 1:
        raise ValueError(f"a draft tree is written BxN or BxN+L with B >= 2, N >= 1 (e.g. 2x3+4), not {name!r}")
    return int(match[1]), int(match[2]), int(match[3] or 0)


def tree_key(block: int, candidates: int, lookup: int) -> str:
    return f"{block}x{candidates}" + (f"+{lookup}" if lookup else "")


def pass_width(block: int, candidates: int, lookup: int) -> int:
    """Tokens in a lossless pass over a full tree: the root and its drafts, each followed by a group of B-1 masks."""
    drafts = (block - 1) + (candidates - 1) + lookup
    return (drafts + 1) * block


def choose_tree(acceptance: dict, costs: dict, margin: float = MARGIN) -> tuple[int, int, int] | None:
    """The tree of `acceptance` (tree -> tokens per forward) with the most tokens per second under `costs` (pass
    width -> seconds), or `None` where no tree beats plain decoding (1 token per `costs[1]`) by `margin`."""
    return best_rate(acceptance, costs, margin)[0]


def best_rate(acceptance: dict, costs: dict, margin: float = MARGIN) -> tuple[tuple[int, int, int] | None, float]:
    """`(tree, tokens per second)` of `choose_tree`'s choice; `(None, 1 / costs[1])` for plain decoding."""
    best, top = None, margin / costs[1]
    for name, tokens in acceptance.items():
        tree = parse_tree(name)
        rate = tokens / costs[pass_width(*tree)]
        if rate > top:
            best, top = tree, rate
    return best, top if best else 1 / costs[1]


def check_acceptance(acceptance) -> dict:
    """`mars_acceptance`, checked: tree names -> tokens per forward (numbers >= 1)."""
    if not isinstance(acceptance, dict) or not acceptance:
        raise ValueError(f"mars_acceptance must be a dict of draft trees to tokens per forward, got {acceptance!r}")
    for name, tokens in acceptance.items():
        parse_tree(name)
        if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or tokens < 1:
            raise ValueError(f"mars_acceptance[{name!r}] must be tokens per forward (>= 1), got {tokens!r}")
    return acceptance


def machine_key(model, batch_size: int) -> str:
    """What a pass's cost depends on: device (GPU name, or CPU model and the instruction set torch uses), threads,
    dtype, batch size, the model's shape, torch's version."""
    device = model.device
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{_cpu_name()} {torch.backends.cpu.get_cpu_capability()} threads={torch.get_num_threads()}"
    shape = {key: getattr(model.config, key, None) for key in _SHAPE_KEYS}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{device.type}: {where} | {model.dtype} | batch {batch_size} | model {digest} | torch {torch.__version__}"


@functools.cache
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def cache_dir() -> Path:
    """Where hf_mars keeps what it measures or builds once: $HF_MARS_CACHE, else $XDG_CACHE_HOME/hf_mars, else
    ~/.cache/hf_mars."""
    if os.environ.get("HF_MARS_CACHE"):
        return Path(os.environ["HF_MARS_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hf_mars"


def costs_path() -> Path:
    return cache_dir() / "pass_costs.json"


def pass_costs(model, batch_size: int, widths, refresh: bool = False) -> dict[int, float]:
    """Seconds per pass for each of `widths` (and 1) on this machine, measured once and cached (`refresh`: again)."""
    path, key = costs_path(), machine_key(model, batch_size)
    table = json.loads(path.read_text()) if path.is_file() else {}
    known = {int(w): s for w, s in table.get(key, {}).items()} if not refresh else {}
    missing = sorted({1, *widths} - set(known))
    if missing:
        logger.warning("MARS: measuring pass costs on this machine for widths %s (once; cached in %s)", missing, path)
        known.update(measure_pass_costs(model, batch_size, missing))
        table[key] = {str(w): s for w, s in sorted(known.items())}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=1, sort_keys=True))
    return known


@torch.no_grad()
def measure_pass_costs(model, batch_size: int, widths, context: int = 256, repeats: int = 7) -> dict[int, float]:
    """Median seconds of a forward over each of `widths` new tokens after `context` cached ones, at `batch_size`.

    Widths are taken in turn, `repeats` times after one warm-up round, so that drift (clock, other load) falls on all
    of them alike; `torch.utils.benchmark` times one statement at a time, which would not. At batch > 1 the passes
    carry an attention mask with holes, as batched decoding's do (left-padded prompts): attention without a mask
    takes another path at another speed.
    """
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (batch_size, context + max(widths)), device=model.device)
    real = torch.ones_like(ids)
    real[1::2, : max(1, context // 8)] = 0  # every other row left-padded, as in a batch of unequal prompts

    def forward(start: int, end: int, **extra):
        mask = real[:, :end] if batch_size > 1 else None
        model(input_ids=ids[:, start:end], attention_mask=mask, **{CACHE_ARG: cache}, use_cache=True, **extra)

    cache = DynamicCache(config=model.config)
    forward(0, context)
    times = {w: [] for w in widths}
    keep = supports_logits_to_keep(model)
    for round_ in range(repeats + 1):
        for width in widths:
            _sync(model)
            start = time.perf_counter()
            forward(context, context + width, **({"logits_to_keep": width} if keep else {}))
            _sync(model)
            if round_:
                times[width].append(time.perf_counter() - start)
            cache.crop(-width)
    return {w: statistics.median(t) for w, t in times.items()}


def _sync(model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
