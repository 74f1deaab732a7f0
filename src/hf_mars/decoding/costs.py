"""`mars_lossless="auto"`: the draft tree with the most tokens per second on this machine, or none at all.

Two measurements meet here. What a tree earns, tokens per pass, belongs to the checkpoint: `hf-mars tune` measures it
once, on any machine, and stores it in the generation config as `mars_acceptance` (`{"BxN+L": tokens per forward}`,
N an int or per-depth counts, "4x3,2+4": `parse_tree`).
What a pass costs belongs to the machine: the time of a forward over w tokens for this device, dtype, thread count,
batch size and architecture, measured here when asked (`model.mars_measure`, the tools, a server's start: seconds,
or minutes where compiled passes compile; resolving settings never times) and cached per machine in
`$HF_MARS_CACHE/pass_costs.json` (default `~/.cache/hf_mars`). A tree runs only if it beats plain decoding, one
token per one-token pass, by `MARGIN`; otherwise the call is plain `generate()`, which lossless mode's output equals.
So lossless mode is never meaningfully slower than plain decoding in the same dtype, and wide trees run where a wide
pass is nearly free (a GPU at small batch, a CPU with native bfloat16 matrix units).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import os
import platform
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache, GenerationMixin

from .compat import CACHE_ARG, supports_logits_to_keep
from .tree import canonical_candidates, runner_ups

logger = logging.getLogger(__name__)

# A tree must promise this much more than plain decoding: a bare forward's time leaves out the loop's host work per
# pass (choosing, verifying, cache bookkeeping), which plain decoding pays less of
MARGIN = 1.1
OVERHEAD_TREE_WIDTH = 4  # the pass width of the 2x1 tree, which `measure_overheads` times
PREFILL_TOKENS = 256  # the prompt `measure_prefill` times; a prompt's cost is taken as proportional to its length
# How the costs are measured: a cached entry measured another way is measured again
MEASUREMENT = 2
# Timed with less than this share of its threads' CPU time, a process was not alone on the CPU: its figures can be
# off by tens of times (OpenMP threads of two processes spin against each other), so they are measured again.
BUSY_SHARE = 0.75
_RETIMED: set[str] = set()  # keys whose busy figures this process has measured again (once is enough)
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
    """Pass costs that may not be timed now (`measure=False`) are not in the table yet."""


def mask_costs(model, batch_size: int, block_size: int, measure: bool = False) -> list[float]:
    """`mars_mask_cost="auto"`: what 1 .. B-1 masks add to a one-token pass here, from the cached pass costs (0
    while they are not measured, unless `measure`)."""
    try:
        widths = range(1, block_size + 1)
        return mask_shares(pass_costs(model, batch_size, widths, measure=measure).forward, block_size)
    except NotMeasured:
        warn_not_measured('mars_mask_cost="auto"', batch_size, "feeds every mask")
        return [0.0] * (block_size - 1)


def warn_not_measured(setting: str, batch_size: int, meanwhile: str) -> None:
    """Say once per setting and batch size that an `"auto"` setting found no pass costs: resolving settings never
    times (it would stall a `generate()` call, or a server's request, for seconds to minutes); the user does."""
    if (setting, batch_size) in _WARNED:
        return
    _WARNED.add((setting, batch_size))
    logger.warning(
        "MARS: %s needs this machine's pass costs at batch %d, not measured yet: until they are, it %s. "
        "`model.mars_measure(batch_sizes=[%d])` times them once (with the call's cache_implementation and "
        "compile_config, for a compiled path), cached per machine; `hf-mars tune` too.",
        setting,
        batch_size,
        meanwhile,
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
    dtype, batch size, the model's shape, torch's version; how it was measured (`MEASUREMENT`); and whether the
    passes are compiled (`compiled_pass_costs`) or eager."""
    device = model.device
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{_cpu_name()} {torch.backends.cpu.get_cpu_capability()} threads={torch.get_num_threads()}"
    shape = {key: getattr(model.config, key, None) for key in _SHAPE_KEYS}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:12]
    key = f"{device.type}: {where} | {model.dtype} | batch {batch_size} | model {digest} | torch {torch.__version__}"
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


def pass_costs(
    model,
    batch_size: int,
    widths,
    refresh: bool = False,
    limit: float | None = None,
    prefill: bool = False,
    measure: bool = True,
) -> Costs:
    """This machine's `Costs` for `widths` (and 1), measured once and cached per `machine_key` at `cost_batch`
    (`refresh`: again); with `prefill`, also the prompt's forward (`measure_prefill`).

    `limit`: what a pass may cost, in one-token passes, and still pay (the best tree's tokens per forward over the
    margin). A width past it is never timed once a narrower one is measured past it: it counts as costing what that
    one did, a floor, since a wider pass costs no less. Where wide passes are dear (an emulated dtype, a big batch)
    the first use then times a few narrow passes instead of every width. `measure=False`: costs missing from the
    table raise `NotMeasured` instead of being timed (a server's requests, which must not wait for a measurement).
    """
    batch = cost_batch(batch_size)
    path, key = costs_path(), machine_key(model, batch)
    table = _read_table(path)
    entry = table.get(key, {})
    if refresh or ("busy" in entry and key not in _RETIMED):  # timed beside other work: once more, in this process
        entry = {}
    forward = {int(w): s for w, s in entry.get("forward", {}).items()}
    untimed = entry.get("untimed")  # [width, limit]: from that width on, left out by a run with that limit
    wanted = sorted({1, OVERHEAD_TREE_WIDTH, *widths})
    missing = [w for w in wanted if w not in forward and not _past(forward, w, limit, untimed)]
    overhead, per_token = entry.get("overhead"), entry.get("prefill")
    hopeless = _past(forward, OVERHEAD_TREE_WIDTH + 1, limit)  # a pass of the narrowest tree cannot pay
    if missing or (overhead is None and not hopeless) or (prefill and per_token is None):
        if not measure:
            raise NotMeasured(f"pass costs of {key} are not measured yet")
        logger.warning("MARS: measuring pass costs on this machine (once; cached in %s)", path)
        _RETIMED.add(key)
        started = _clocks()
        if missing:
            forward.update(measure_pass_costs(model, batch, missing, limit=limit, one=forward.get(1)))
            left_out = [w for w in missing if w not in forward]
            untimed = [min(left_out), limit] if left_out else untimed
        if overhead is None and not _past(forward, OVERHEAD_TREE_WIDTH + 1, limit):
            overhead = measure_overheads(model, batch, forward)
        if prefill and per_token is None:
            per_token = measure_prefill(model, batch) / PREFILL_TOKENS
        table[key] = {"forward": {str(w): s for w, s in sorted(forward.items())}, "overhead": overhead}
        table[key].update({"untimed": untimed} if untimed else {})
        table[key].update({"prefill": per_token} if per_token is not None else {})
        _mark_busy(table[key], _cpu_share(started) if model.device.type == "cpu" else 1.0, entry.get("busy"))
        _write_table(path, table)
    known = {w: forward[w] if w in forward else _floor(forward, w, limit) for w in wanted}
    return Costs(known, **(overhead or dict(plain_overhead=0.0, mars_overhead=0.0)), prefill=per_token)


def compiled_pass_costs(
    model, batch_size: int, trees, compile_config=None, refresh: bool = False, measure: bool = True, acceptance=None
) -> Costs:
    """`Costs` of the path a compiled call runs (a static cache and `generate()`'s compile path): a plain compiled
    step for width 1, and for each lossless tree its whole graph pass (`graph.py`: forward and bookkeeping in one),
    by the tree's width, with no overheads beside them. Measured on the compiled passes themselves (each compiles
    once, which takes a while), cached per `machine_key(..., compiled=True)` at `cost_batch`.

    With `acceptance` (tree name -> tokens per forward) only the trees that could still win are timed
    (`_worth_timing`); the others count at a floor, the cost of the widest narrower pass timed, which a wider pass
    never undercuts, and lose at it. On a GPU, where a graph pass costs about the same at any width, that saves
    most of the compiles."""
    batch = cost_batch(batch_size)
    path, key = costs_path(), machine_key(model, batch, compiled=True)
    table = _read_table(path)
    forward = {} if refresh else {int(w): s for w, s in table.get(key, {}).get("forward", {}).items()}
    widths = sorted({pass_width(*tree) for tree in trees})
    earns = {}  # width -> the most tokens per forward a tree of that width makes
    for name, tokens in (acceptance or {}).items():
        width = pass_width(*parse_tree(name))
        earns[width] = max(tokens, earns.get(width, 0.0))
    while (missing := _worth_timing(forward, widths, earns)) is not None:
        if not measure:
            raise NotMeasured(f"compiled pass costs of {key} are not measured yet")
        if not forward:
            logger.warning("MARS: measuring compiled pass costs on this machine (once; cached in %s)", path)
        tree = None if missing == 1 else next(t for t in trees if pass_width(*t) == missing)
        forward.update(measure_compiled_passes(model, batch, [tree], compile_config))
        table = _read_table(path)
        table[key] = {"forward": {str(w): s for w, s in sorted(forward.items())}}
        _write_table(path, table)
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


@torch.no_grad()
def measure_compiled_passes(model, batch_size: int, trees, compile_config=None, new_tokens: int = 24) -> dict:
    """Seconds per step of plain compiled `generate()` (tree `None`, width 1) and per pass of lossless mode with each
    tree (by its width), on a static cache through `generate()`'s compile path, on a random prompt with no
    end-of-sequence token; each call runs once to compile before it is timed."""
    ids, real = _random_batch(model, batch_size, 64, 64)
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id, config.do_sample, config.max_new_tokens = None, False, new_tokens
    config.cache_implementation, config.return_dict_in_generate = "static", True
    if compile_config is not None:
        config.compile_config = compile_config
    seconds = {}
    for tree in trees:
        if tree is None:
            call = functools.partial(GenerationMixin.generate, model, ids, generation_config=config)
        else:
            lossless = dict(mars_verify=True, mars_tau=0.0, mars_mask_cost=0.0)
            lossless.update(zip(("mars_block_size", "mars_draft_candidates", "mars_lookup"), tree))
            call = functools.partial(model.generate, ids, generation_config=config, **lossless)
        call(attention_mask=real)  # compiles
        sync(model)
        start = time.perf_counter()
        out = call(attention_mask=real)
        sync(model)
        passes = out.mars_stats.forward_passes if tree is not None else new_tokens
        seconds[1 if tree is None else pass_width(*tree)] = (time.perf_counter() - start) / passes
    return seconds


def _read_table(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _write_table(path: Path, table: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, sort_keys=True))


def _mark_busy(entry: dict, share: float, before: float | None) -> None:
    """Mark a cache entry timed with `share` of the CPU as busy, below `BUSY_SHARE` (an entry timed busy before stays
    marked as it grows), and say so: the next process times it again."""
    busy = min(share, 1.0 if before is None else before)
    if busy < BUSY_SHARE:
        entry["busy"] = round(busy, 2)
    if share < BUSY_SHARE:
        logger.warning(
            "MARS: other work was running while the pass costs were timed (this process had %.0f%% of its threads' "
            "CPU time), so they may be far off. The next process times them again; or run `hf-mars tune "
            "--refresh-costs` when the machine is idle.",
            100 * share,
        )


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _cpu_share(started: tuple[float, float]) -> float:
    """CPU time this process got since `started` (`_clocks`), as a share of the wall time its threads span: near 1
    alone on the CPU (waiting OpenMP threads spin, which counts), about 1/2 or less beside another busy process."""
    wall, cpu = time.perf_counter() - started[0], time.process_time() - started[1]
    return cpu / max(wall * torch.get_num_threads(), 1e-9)


def _past(forward: dict[int, float], width: int, limit: float | None, untimed: list | None = None) -> bool:
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


@torch.no_grad()
def measure_pass_costs(
    model, batch_size: int, widths, context: int = 256, repeats: int = 7, limit: float | None = None, one=None
) -> dict[int, float]:
    """Median seconds of a forward over each of `widths` new tokens after `context` cached ones, at `batch_size`.

    Widths are taken in turn, `repeats` times after one warm-up round, so that drift (clock, other load) falls on all
    of them alike; `torch.utils.benchmark` times one statement at a time, which would not. At batch > 1 the passes
    carry an attention mask with holes, as batched decoding's do (left-padded prompts): attention without a mask
    takes another path at another speed. `limit` (see `pass_costs`; `one`: a one-token pass's seconds where width 1
    is not among `widths`): the warm-up goes from narrow to wide and stops at the first width clearly past it; the
    wider ones are left out.
    """
    ids, real = _random_batch(model, batch_size, context + max(widths), context)
    keep = supports_logits_to_keep(model)
    cache = DynamicCache(config=model.config)

    def timed(width: int) -> float:
        mask = real[:, : context + width] if batch_size > 1 else None
        extra = {"logits_to_keep": width} if keep else {}
        sync(model)
        start = time.perf_counter()
        model(
            input_ids=ids[:, context : context + width],
            attention_mask=mask,
            **{CACHE_ARG: cache},
            use_cache=True,
            **extra,
        )
        sync(model)
        seconds = time.perf_counter() - start
        cache.crop(-width)
        return seconds

    prefill_mask = real[:, :context] if batch_size > 1 else None
    model(input_ids=ids[:, :context], attention_mask=prefill_mask, **{CACHE_ARG: cache}, use_cache=True)
    kept = []
    for width in sorted(widths):  # the warm-up round
        seconds = timed(width)
        one = seconds if width == 1 else one
        kept.append(width)
        # 1.25: a margin for a cold first run
        if limit is not None and width > 1 and one is not None and seconds > 1.25 * limit * one:
            break
    times = {w: [] for w in kept}
    for _ in range(repeats):
        for width in kept:
            times[width].append(timed(width))
    return {w: statistics.median(t) for w, t in times.items()}


@torch.no_grad()
def measure_prefill(model, batch_size: int, context: int = PREFILL_TOKENS, repeats: int = 2) -> float:
    """Seconds of the forward over a `context`-token prompt at `batch_size` (padded as `_random_batch`), the fastest of
    `repeats`. Where wide passes are dear (an emulated dtype, a big batch), reading the prompt can cost as much as
    generating a hundred tokens, and a dtype that steps faster may still finish later."""
    ids, real = _random_batch(model, batch_size, context, context)
    mask = real if batch_size > 1 else None
    keep = {"logits_to_keep": 1} if supports_logits_to_keep(model) else {}
    best = float("inf")
    for _ in range(repeats):
        sync(model)
        start = time.perf_counter()
        model(
            input_ids=ids,
            attention_mask=mask,
            use_cache=True,
            **{CACHE_ARG: DynamicCache(config=model.config)},
            **keep,
        )
        sync(model)
        best = min(best, time.perf_counter() - start)
    return best


@torch.no_grad()
def measure_overheads(model, batch_size: int, forward: dict[int, float], context: int = 256, repeats: int = 2) -> dict:
    """What a step adds to its bare forward (`forward`, by width): plain `generate()` per token, and a lossless pass
    with the narrowest tree (2x1) per pass, each timed at two lengths so that the prompt's prefill cancels out, on a
    random prompt with no end-of-sequence token."""
    ids, real = _random_batch(model, batch_size, context, context)
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id, config.do_sample = None, False
    tree = dict(mars_verify=True, mars_tau=0.0, mars_block_size=2, mars_draft_candidates=1, mars_lookup=0)

    def steps(plain: bool, new_tokens: int) -> tuple[float, int]:
        config.max_new_tokens, config.return_dict_in_generate = new_tokens, not plain
        sync(model)
        start = time.perf_counter()
        if plain:
            count = GenerationMixin.generate(model, ids, generation_config=config, attention_mask=real).shape[1]
            count -= context
        else:
            out = model.generate(ids, generation_config=config, attention_mask=real, mars_mask_cost=0.0, **tree)
            count = out.mars_stats.forward_passes
        sync(model)
        return time.perf_counter() - start, count

    # The fastest of the rounds at each length: a pause of the machine lengthens a run, never shortens it
    fastest, counts = {}, {}
    for round_ in range(repeats + 1):  # the first round warms up
        for plain in (True, False):
            for length in (4, 20):
                seconds, counts[plain, length] = steps(plain, length)
                if round_:
                    fastest[plain, length] = min(seconds, fastest.get((plain, length), seconds))
    per_step = {
        plain: (fastest[plain, 20] - fastest[plain, 4]) / max(counts[plain, 20] - counts[plain, 4], 1)
        for plain in (True, False)
    }
    return {
        "plain_overhead": max(0.0, per_step[True] - forward[1]),
        "mars_overhead": max(0.0, per_step[False] - forward[OVERHEAD_TREE_WIDTH]),
    }


def _random_batch(model, batch_size: int, length: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`length` random token ids per row, and the attention mask of a batch of unequal prompts: every other row
    left-padded by an eighth of `context`. A mask with holes takes attention's masked path, as batched decoding of
    real prompts does; at batch 1 there are none."""
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (batch_size, length), device=model.device)
    real = torch.ones_like(ids)
    real[1::2, : max(1, context // 8)] = 0
    return ids, real


def sync(model) -> None:
    """Wait for the model's device to finish its work (a GPU runs ahead of the host), before a clock is read."""
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


# Which dtype to decode in. Plain bfloat16 decoding is faster than float32 on most CPUs (half the bytes to read), but
# a wide bfloat16 pass is cheap only where the CPU computes bfloat16 natively (AVX512-BF16, AMX) or on a GPU;
# elsewhere it is emulated, and a draft tree can lose what the dtype gained, as can the prompt's forward, the widest
# pass of all. So the choice is made from the same pass costs, per dtype, the prompt's cost and the checkpoint's
# `mars_acceptance`, for a call of a given prompt length and number of new tokens.
PROMPT_TOKENS, NEW_TOKENS = 256, 256  # the call `choose_dtype` plans for when it is not told


@dataclass
class DtypeChoice:
    dtype: torch.dtype
    plain: dict[torch.dtype, float]  # expected tokens/s per row of plain decoding, prompt included, by dtype
    lossless: dict[torch.dtype, tuple[tuple | None, float]]  # ((B, N, L) or None, tokens/s per row), by dtype
    prefill: dict[torch.dtype, float]  # expected seconds of the prompt's forward, by dtype
    prompt_tokens: int = PROMPT_TOKENS
    new_tokens: int = NEW_TOKENS

    @property
    def fastest_plain(self) -> torch.dtype:
        return max(self.plain, key=self.plain.get)

    def reason(self) -> str:
        """One line: what was chosen, and the expected rates that chose it."""

        def rate(dtype):
            tree, tokens = self.lossless[dtype]
            how = f"tree {tree_key(*tree)}" if tree else "plain, no tree pays"
            plain, prompt = self.plain[dtype], self.prefill[dtype]
            return f"{_name(dtype)} {tokens:.1f} tokens/s ({how}; plain {plain:.1f}; prompt {prompt:.1f} s)"

        call = f"{self.prompt_tokens}-token prompt, {self.new_tokens} new tokens"
        return f"dtype {_name(self.dtype)}: expected lossless for a {call}: " + ", ".join(map(rate, self.lossless))


def candidate_dtypes(model) -> list[torch.dtype]:
    """float32, and bfloat16 where the device runs it at all: every CPU torch runs on, a GPU that supports it."""
    if model.device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return [torch.float32]
    return [torch.float32, torch.bfloat16]


def choose_dtype(
    model, batch_size: int = 1, prompt_tokens: int = PROMPT_TOKENS, new_tokens: int = NEW_TOKENS
) -> DtypeChoice:
    """The dtype of the highest expected lossless tokens per second at `batch_size` for a call that reads a
    `prompt_tokens`-long prompt and writes `new_tokens` (a plain one-token pass where the checkpoint has no
    `mars_acceptance`): the prompt's forward, then the steps. Costs seconds per dtype the first time on a machine."""
    acceptance = getattr(model.generation_config, "mars_acceptance", None)
    acceptance = check_acceptance(acceptance) if acceptance else {}
    widths = [pass_width(*parse_tree(name)) for name in acceptance]
    limit = pay_limit(acceptance) if acceptance else None
    plain, lossless, prefill = {}, {}, {}
    for dtype in candidate_dtypes(model):
        copied = in_dtype(model, dtype)
        costs = pass_costs(copied, batch_size, widths, limit=limit, prefill=True)
        prefill[dtype] = seconds = costs.prefill * prompt_tokens
        tree, rate = best_rate(acceptance, costs)
        plain[dtype] = new_tokens / (seconds + new_tokens / costs.plain_rate())
        lossless[dtype] = (tree, new_tokens / (seconds + new_tokens / rate))
        del copied
    best = max(lossless, key=lambda d: lossless[d][1])
    return DtypeChoice(best, plain, lossless, prefill, prompt_tokens, new_tokens)


def in_dtype(model, dtype: torch.dtype):
    """`model` in `dtype`: itself if it is, else a converted copy (the original stays as it is)."""
    return model if model.dtype == dtype else copy.deepcopy(model).to(dtype)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
