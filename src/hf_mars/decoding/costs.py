"""`mars_lossless="auto"`: the draft tree with the most tokens per second on this machine, or none at all.

Two measurements meet here. What a tree earns, tokens per pass, belongs to the checkpoint: `hf-mars tune` measures it
once, on any machine, and stores it in the generation config as `mars_acceptance` (`{"BxN+L": tokens per forward}`,
N an int or per-depth counts, "4x3,2+4": `parse_tree`).
What a pass costs belongs to the machine: the time of a forward over w tokens for this device, dtype, thread count,
batch size and architecture, cached per machine in `$HF_MARS_CACHE/pass_costs.json` (default `~/.cache/hf_mars`).
This file reads that table and chooses from it; it never times. Timing is hf_mars's tooling
(`hf_mars.measure(model, ...)`, `hf-mars tune`, a server's start), run when a user asks: seconds, or minutes where
compiled passes compile. A tree runs only if it beats plain decoding, one token per one-token pass, by `MARGIN`;
otherwise the call is plain `generate()`, which lossless mode's output equals. So lossless mode is never meaningfully
slower than plain decoding in the same dtype, and wide trees run where a wide pass is nearly free (a GPU at small
batch, a CPU with native bfloat16 matrix units).

Where this machine's costs are not in the table (not timed yet, or timed while other work held the CPU, which can put
them off by tens of times), the choice is made from `prior_costs`: how a pass's cost grows with its width on this
kind of device, as measured on such devices (docs/benchmarks.md). So `"auto"` drafts from the first call where
drafting is known to pay (a GPU, a CPU with native bfloat16), and never rests on a timing known to be unreliable.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .tree import canonical_candidates, runner_ups

logger = logging.getLogger(__name__)

# A tree must promise this much more than plain decoding: a bare forward's time leaves out a pass's host work per
# pass (choosing, verifying, cache bookkeeping), which plain decoding pays less of
MARGIN = 1.1
OVERHEAD_TREE_WIDTH = 4  # the pass width of the 2x1 tree, whose step overheads the table holds
# How the costs are measured: a cached entry measured another way is measured again
MEASUREMENT = 2
_TREE = re.compile(r"^(\d+)x(\d+(?:,\d+)*)(?:\+(\d+))?$")
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


def parse_tree(name: str) -> tuple[int, int | tuple[int, ...], int]:
    """`"BxN"`, `"BxN+L"` or `"Bx4,3,2+L"` -> `(B, N, L)`: block size, `mars_draft_candidates` (N for the first
    draft, or counts per draft depth, at most B-1 of them; in `canonical_candidates` form), prompt-lookup drafts."""
    match = _TREE.match(str(name))
    counts = [int(k) for k in match[2].split(",")] if match else []
    if match is None or int(match[1]) < 2 or min(counts) < 1 or len(counts) > int(match[1]) - 1:
        raise ValueError(
            "a draft tree is written BxN or BxN+L with B >= 2, N >= 1 (e.g. 2x3+4), N also as counts per draft "
            f"depth, at most B-1 of them (e.g. 4x3,2+4), not {name!r}"
        )
    return int(match[1]), canonical_candidates(counts), int(match[3] or 0)


def tree_key(block: int, candidates, lookup: int) -> str:
    """The name of a tree in `mars_acceptance`: `parse_tree`'s inverse, candidates in `canonical_candidates` form."""
    counts = canonical_candidates(candidates)
    written = str(counts) if isinstance(counts, int) else ",".join(map(str, counts))
    return f"{block}x{written}" + (f"+{lookup}" if lookup else "")


def pass_width(block: int, candidates, lookup: int) -> int:
    """Tokens in a lossless pass over a full tree: the root and its drafts, each followed by a group of B-1 masks."""
    drafts = (block - 1) + runner_ups(candidates) + lookup
    return (drafts + 1) * block


@dataclass
class Costs:
    """What decoding costs on this machine at one dtype and batch size, in seconds: a bare forward by pass width, and
    what a step adds to its forward (choosing tokens, the cache, Python and dispatch: all of a step's time on a GPU
    at small batch), for plain `generate()` per token and for a lossless pass."""

    forward: dict[int, float]
    plain_overhead: float = 0.0
    mars_overhead: float = 0.0
    prefill: float | None = None  # a forward over the prompt, per prompt token (measured for the dtype choice)

    def plain_rate(self) -> float:
        """Tokens per second of plain decoding."""
        return 1 / (self.forward[1] + self.plain_overhead)

    def tree_rate(self, tree: tuple, tokens_per_forward: float) -> float:
        """Tokens per second of lossless mode with `tree`, at that many tokens per forward."""
        return tokens_per_forward / (self.forward[pass_width(*tree)] + self.mars_overhead)


class NotMeasured(LookupError):
    """Pass costs that are not in the table (or not trusted), where no timer was given to time them, or the timer
    would not (the machine is busy)."""


# How a forward's cost grows with the tokens it holds (all rows' together), in one-token forwards, by kind of device:
# (tokens, cost) points, linear between them and past the last. Read off passes timed on such devices
# (docs/benchmarks.md, "What auto chooses before it has timed anything"); a prior, used only where this machine's own
# costs are missing or untrusted.
PRIOR_CURVES = {
    "cuda": ((1, 1.0), (16, 1.4), (64, 1.8), (256, 3.0), (2048, 16.0)),
    "cpu, native bfloat16": ((1, 1.0), (4, 1.3), (8, 1.55), (16, 2.1), (64, 5.4)),
    "cpu, float32": ((1, 1.0), (2, 1.7), (4, 1.9), (8, 2.0), (16, 2.1), (32, 2.4), (64, 3.2)),
    "cpu, emulated 16-bit": ((1, 1.0), (2, 1.25), (4, 1.8), (8, 3.0), (16, 5.2), (32, 9.6), (64, 18.0)),
}
# A one-token forward's cost by dtype, in float32 one-token forwards: half the bytes to read per weight
PRIOR_STEP = {torch.float32: 1.0, torch.bfloat16: 0.6, torch.float16: 0.6}


def device_kind(model) -> str:
    """The kind of device whose `PRIOR_CURVES` stands for this model's passes: a GPU, or a CPU by how it computes
    the model's dtype (bfloat16 natively with AVX512-BF16 or AMX, else emulated)."""
    if model.device.type == "cuda":
        return "cuda"
    if model.dtype == torch.float32:
        return "cpu, float32"
    native = model.dtype == torch.bfloat16 and bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
    return "cpu, native bfloat16" if native else "cpu, emulated 16-bit"


@functools.cache
def cpu_flags() -> frozenset:
    """The CPU's feature flags (`/proc/cpuinfo`; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as info:
            line = next((line for line in info if line.startswith(("flags", "Features"))), ":")
    except OSError:
        return frozenset()
    return frozenset(line.split(":", 1)[1].split())


def prior_cost(kind: str, tokens: float) -> float:
    """A forward over `tokens` tokens on a device of this `kind`, in one-token forwards (`PRIOR_CURVES`)."""
    points = PRIOR_CURVES[kind]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if tokens <= x1 or (x1, y1) == points[-1]:
            return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
    return points[0][1]


def prior_costs(model, batch_size: int, widths) -> Costs:
    """`Costs` from what is known of this kind of device (`device_kind`), not timed: each width's forward over the
    batch's tokens, in this dtype's one-token forwards (`PRIOR_STEP`, so dtypes compare), and the prompt's forward per
    token from a 256-token one. No overheads: `MARGIN` stands for them."""
    kind, step = device_kind(model), PRIOR_STEP.get(model.dtype, 1.0)
    rows = cost_batch(batch_size)
    forward = {w: step * prior_cost(kind, rows * w) / prior_cost(kind, rows) for w in sorted({1, *widths})}
    return Costs(forward, prefill=step * prior_cost(kind, 256) / 256)


def mask_costs(model, batch_size: int, block_size: int, timer=None) -> list[float]:
    """`mars_mask_cost="auto"`: what 1 .. B-1 masks add to a one-token pass here, from the cached pass costs (where
    they are missing and no `timer` times them, from `prior_costs`)."""
    costs = costs_or_prior(model, batch_size, range(1, block_size + 1), 'mars_mask_cost="auto"', timer=timer)
    return mask_shares(costs.forward, block_size)


def costs_or_prior(model, batch_size: int, widths, setting: str, limit=None, timer=None) -> Costs:
    """`pass_costs`, or `prior_costs` where this machine's are missing or untrusted (said once per setting and batch
    size)."""
    try:
        return pass_costs(model, batch_size, widths, limit, timer=timer)
    except NotMeasured:
        warn_not_measured(setting, model, batch_size)
        return prior_costs(model, batch_size, widths)


def warn_not_measured(setting: str, model, batch_size: int) -> None:
    """Say once per setting and batch size that an `"auto"` setting chose from `prior_costs`: resolving settings
    never times (it would stall a `generate()` call, or a server's request); hf_mars's tools do, once per machine."""
    if (setting, batch_size) in _WARNED:
        return
    _WARNED.add((setting, batch_size))
    logger.warning(
        "MARS: %s at batch %d chose from what is known of %s (%s), this machine's pass costs being untimed or "
        "untrusted. With hf_mars installed, `hf_mars.measure(model, batch_sizes=[%d])` times them (seconds, once per "
        "machine, skipped while other work holds the CPU); `hf-mars tune` too.",
        setting,
        batch_size,
        "GPUs" if device_kind(model) == "cuda" else "CPUs",
        device_kind(model),
        batch_size,
    )


_WARNED: set = set()


def mask_shares(forward: dict[int, float], block_size: int) -> list[float]:
    """Forward costs by width -> `mars_mask_cost` as a list: `t(k+1) / t(1) - 1` for k = 1 .. B-1 masks."""
    return [round(max(0.0, forward[w] / forward[1] - 1), 3) for w in range(2, block_size + 1)]


def choose_tree(acceptance: dict, costs: Costs, margin: float = MARGIN) -> tuple | None:
    """The tree of `acceptance` (tree -> tokens per forward) with the most tokens per second under `costs`, or `None`
    where no tree beats plain decoding by `margin`."""
    return best_rate(acceptance, costs, margin)[0]


def best_rate(acceptance: dict, costs: Costs, margin: float = MARGIN) -> tuple[tuple | None, float]:
    """`(tree, tokens per second)` of `choose_tree`'s choice; `(None, plain decoding's rate)` where none pays."""
    best, top = None, margin * costs.plain_rate()
    for name, tokens in acceptance.items():
        tree = parse_tree(name)
        rate = costs.tree_rate(tree, tokens)
        if rate > top:
            best, top = tree, rate
    return best, top if best else costs.plain_rate()


def pay_limit(acceptance: dict) -> float:
    """The most a pass may cost, in one-token passes, for the best tree of `acceptance` to beat plain decoding."""
    return max(acceptance.values()) / MARGIN


def check_acceptance(acceptance) -> dict:
    """`mars_acceptance`, checked: tree names (`parse_tree`'s, per-depth counts included) -> tokens per forward
    (numbers >= 1)."""
    if not isinstance(acceptance, dict) or not acceptance:
        raise ValueError(f"mars_acceptance must be a dict of draft trees to tokens per forward, got {acceptance!r}")
    for name, tokens in acceptance.items():
        parse_tree(name)
        if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or tokens < 1:
            raise ValueError(f"mars_acceptance[{name!r}] must be tokens per forward (>= 1), got {tokens!r}")
    return acceptance


def machine_key(model, batch_size: int, compiled: bool = False) -> str:
    """What a pass's cost depends on: device (GPU name, or CPU model and the instruction set torch uses), threads,
    dtype, batch size, the model's shape, torch's version; how it was measured (`MEASUREMENT`); whether the passes
    are compiled (`compiled_pass_costs`) or eager; and the attention implementation where it is not `sdpa` (`ordered`
    costs a wide pass more: the key of `sdpa`'s costs, timed before others were told apart, stays as it was)."""
    device = model.device
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{_cpu_name()} {torch.backends.cpu.get_cpu_capability()} threads={torch.get_num_threads()}"
    shape = {key: getattr(model.config, key, None) for key in _SHAPE_KEYS}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:12]
    key = f"{device.type}: {where} | {model.dtype} | batch {batch_size} | model {digest} | torch {torch.__version__}"
    attention = getattr(model.config, "_attn_implementation", None)
    key += f" | attention {attention}" if attention not in (None, "sdpa") else ""
    return f"{key} | measured {MEASUREMENT}" + (" | compiled passes" if compiled else "")


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


def cost_batch(batch_size: int) -> int:
    """The batch size whose pass costs stand for `batch_size`: the next power of two. How a pass's cost grows with
    its width changes slowly with the batch, and a server that meets every size up to 64 measures seven of them, not
    sixty-four, each a pause for the requests waiting on it."""
    return 1 << (max(batch_size, 1) - 1).bit_length()


def pass_costs(model, batch_size: int, widths, limit: float | None = None, prefill: bool = False, timer=None) -> Costs:
    """This machine's `Costs` for `widths` (and 1), as the table holds them at `cost_batch(batch_size)`; with
    `prefill`, also the prompt's forward per token.

    `limit`: what a pass may cost, in one-token passes, and still pay (the best tree's tokens per forward over the
    margin). A width past it need not be timed once a narrower one is measured past it: it counts as costing what that
    one did, a floor, since a wider pass costs no less. Costs missing from the table raise `NotMeasured`, or, given a
    `timer` (hf_mars's tooling, `tools/measure/passes.py`), are timed now and saved.
    """
    batch = cost_batch(batch_size)
    key, wanted = machine_key(model, batch), sorted({1, OVERHEAD_TREE_WIDTH, *widths})
    entry = trusted(read_table(costs_path()).get(key, {}))
    widths_missing, _, prefill_missing = missing_costs(entry, wanted, limit, prefill)
    if widths_missing or prefill_missing:
        if timer is None:
            raise NotMeasured(f"pass costs of {key} are not measured yet")
        entry = timer.time_passes(model, batch, key, entry, wanted, limit, prefill)
    forward = forward_costs(entry)
    known = {w: forward[w] if w in forward else _floor(forward, w, limit) for w in wanted}
    for narrower, wider in zip(wanted, wanted[1:]):  # a wider forward costs no less: a timing that says so is noise
        known[wider] = max(known[wider], known[narrower])
    overhead = entry.get("overhead") or dict(plain_overhead=0.0, mars_overhead=0.0)
    return Costs(known, **overhead, prefill=entry.get("prefill"))


def missing_costs(entry: dict, wanted: list[int], limit: float | None, prefill: bool) -> tuple[list[int], bool, bool]:
    """What a table entry lacks for `pass_costs`: the forward widths (those `limit` rules out aside), whether the
    steps' overheads (not where even the narrowest tree cannot pay), whether the prompt's forward."""
    forward, untimed = forward_costs(entry), entry.get("untimed")  # untimed: [width, limit] that a run left out
    widths = [w for w in wanted if w not in forward and not past_limit(forward, w, limit, untimed)]
    overhead = entry.get("overhead") is None and not past_limit(forward, OVERHEAD_TREE_WIDTH + 1, limit)
    return widths, overhead, prefill and entry.get("prefill") is None


def forward_costs(entry: dict) -> dict[int, float]:
    """A table entry's forward seconds by width."""
    return {int(w): s for w, s in entry.get("forward", {}).items()}


def trusted(entry: dict) -> dict:
    """The entry, or {} where it was timed while other work held part of the CPU (`busy`): its figures can be off by
    tens of times. A choice never rests on it; a process that finds the machine idle times it again."""
    return {} if "busy" in entry else entry


def compiled_pass_costs(model, batch_size: int, trees, compile_config=None, acceptance=None, timer=None) -> Costs:
    """`Costs` of the path a compiled call runs (a static cache and `generate()`'s compile path): a plain compiled
    step for width 1, and for each lossless tree its whole graph pass (`graph.py`: forward and bookkeeping in one),
    by the tree's width, with no overheads beside them; cached per `machine_key(..., compiled=True)` at `cost_batch`.

    With `acceptance` (tree name -> tokens per forward) only the trees that could still win need timing
    (`_worth_timing`); the others count at a floor, the cost of the widest narrower pass timed, which a wider pass
    never undercuts, and lose at it. On a GPU, where a graph pass costs about the same at any width, that saves
    most of the compiles (each timed width compiles once). Missing costs: as in `pass_costs`."""
    batch = cost_batch(batch_size)
    key = machine_key(model, batch, compiled=True)
    forward = forward_costs(read_table(costs_path()).get(key, {}))
    widths = sorted({pass_width(*tree) for tree in trees})
    earns = {}  # width -> the most tokens per forward a tree of that width makes
    for name, tokens in (acceptance or {}).items():
        width = pass_width(*parse_tree(name))
        earns[width] = max(tokens, earns.get(width, 0.0))
    while (missing := _worth_timing(forward, widths, earns)) is not None:
        if timer is None:
            raise NotMeasured(f"compiled pass costs of {key} are not measured yet")
        tree = None if missing == 1 else next(t for t in trees if pass_width(*t) == missing)
        forward = timer.time_compiled(model, batch, key, forward, tree, compile_config)
    return Costs({w: forward[w] if w in forward else _below(forward, w) for w in {1, *widths}})


def _worth_timing(forward: dict[int, float], widths: list[int], earns: dict[int, float]) -> int | None:
    """The next width to time (1: the plain step), or None once the rest cannot win. Without `earns` (width -> the
    most tokens per forward a tree of that width makes) every width is timed. With them: the plain step and the
    narrowest tree first, then, of the widths whose tokens over their floor (`_below`) could still reach the best
    rate timed so far (or plain decoding's by `MARGIN`), the middle one, which tightens the others' floors."""
    untimed = [w for w in (1, *widths) if w not in forward]
    if not earns or not untimed or 1 in untimed or widths[0] in untimed:
        return untimed[0] if untimed else None
    best = max([MARGIN / forward[1]] + [earns[w] / forward[w] for w in widths if w in forward and w in earns])
    open_ = [w for w in untimed if earns.get(w, float("inf")) / _below(forward, w) >= best]
    return open_[len(open_) // 2] if open_ else None


def _below(forward: dict[int, float], width: int) -> float:
    """The cost of the widest pass timed narrower than `width` (a tree's pass, not the plain step): a floor."""
    return forward[max(w for w in forward if 1 < w < width)]


def read_table(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def past_limit(forward: dict[int, float], width: int, limit: float | None, untimed: list | None = None) -> bool:
    """Whether `width` cannot pay under `limit` (one-token passes) without timing it: a narrower pass is measured
    past the limit, or a run with this limit or a larger one left it out."""
    if limit is None:
        return False
    left_out = untimed is not None and width >= untimed[0] and limit <= untimed[1]
    return left_out or any(w < width and s > limit * forward[1] for w, s in forward.items())


def _floor(forward: dict[int, float], width: int, limit: float) -> float:
    """The cost an untimed `width` counts as: the widest narrower pass's, and at least `limit` one-token passes (a
    wider pass costs no less; past the limit, it loses)."""
    return max(forward[max(w for w in forward if w < width)], limit * forward[1])
