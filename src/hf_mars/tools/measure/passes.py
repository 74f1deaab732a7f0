"""Timing this machine's pass costs: what `mars_lossless="auto"` and `mars_mask_cost="auto"` read.

A checkpoint's code (`decoding/costs.py`) reads the cost table and chooses from it, and never times: a `generate()`
call or a server's request must not stall while a model is timed, and the code a checkpoint carries stays what
decoding needs. Timing lives here and runs when a user asks: `measure(model, ...)` (`hf_mars.measure`), `hf-mars
tune`, `hf-mars generate`, the server's start, the bench. `PassTimer` is what the reading code calls where a cost is
missing: it times the passes (`measure_pass_costs`, `measure_prefill`; the steps' overheads `measure_overheads` and
compiled passes `measure_compiled_passes` where asked) in seconds, with a progress bar, and saves them in the table.

A busy machine is not timed: where other work holds cores torch's threads would use, figures are off by up to tens of
times (`cpu_load.py`), so the timer declines (`NotMeasured`), and the choice is made from what is known of this kind
of device (`costs.prior_costs`) until a process finds the machine idle. Figures timed while other work came and went
are saved marked `busy`, which no choice reads, and timed again by the next process that finds the machine idle.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import time

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, GenerationMixin

from ...decoding import costs
from ...decoding.compat import CACHE_ARG, supports_logits_to_keep
from ...decoding.settings import CALL_KEYS, resolve_settings
from .cpu_load import BUSY_SHARE, busy_cores, clocks, timing_share

logger = logging.getLogger(__name__)

# Set to 1: time pass costs even while other work holds the CPU, and use them (figures may be far off; said)
TIME_BUSY_ENV = "HF_MARS_TIME_BUSY"
PREFILL_TOKENS = 128  # the prompt `measure_prefill` times; a prompt's cost is taken as proportional to its length
_DECLINED: set = set()  # cost-table keys this process found the machine too busy to time: not probed again


def measure(model, batch_sizes=(1,), generation_config=None, overheads: bool = False, **kwargs) -> dict:
    """Time on this machine what `"auto"` settings read (lossless mode's tree, `mars_mask_cost`), for calls of these
    batch sizes made with `kwargs` (with `cache_implementation="static"` and, off a GPU, a `compile_config`, the
    compiled passes those calls run), and cache it per machine. `generate()` never times: until this runs (or
    `hf-mars tune`), `"auto"` settings choose from what is known of this kind of device. Takes seconds (compiled
    passes: minutes, each tree width compiles once); a busy machine is not timed. `overheads`: also time what a step
    adds to its forward (`measure_overheads`: about as long again; `MARGIN` stands for it otherwise). Returns
    `{batch size: the settings calls of that size now run with}` (`None`: plain)."""
    call = {name: kwargs.pop(name) for name in CALL_KEYS if name in kwargs}
    timer = PassTimer(overheads=overheads)
    resolved = {b: resolve_settings(model, generation_config, b, call, timer, **kwargs) for b in batch_sizes}
    return {b: None if settings is None else settings.as_kwargs() for b, settings in resolved.items()}


def pass_costs(model, batch_size: int, widths, refresh: bool = False, limit=None, prefill: bool = False, timer=None):
    """`costs.pass_costs`, timing what the table misses (`refresh`: everything again, `hf-mars tune
    --refresh-costs`); `timer`: a `PassTimer` (default: one that declines on a busy machine)."""
    if refresh:
        save(costs.machine_key(model, costs.cost_batch(batch_size)), None)
    return costs.pass_costs(model, batch_size, widths, limit, prefill, timer=timer or PassTimer())


def compiled_pass_costs(model, batch_size: int, trees, compile_config=None, refresh: bool = False, acceptance=None):
    """`costs.compiled_pass_costs`, timing what the table misses (`refresh`: everything again)."""
    if refresh:
        save(costs.machine_key(model, costs.cost_batch(batch_size), compiled=True), None)
    return costs.compiled_pass_costs(model, batch_size, trees, compile_config, acceptance, timer=PassTimer())


class PassTimer:
    """Times the pass costs that `costs.pass_costs` and `costs.compiled_pass_costs` find missing, and saves them.

    `overheads`: also time what a step adds to its bare forward (`measure_overheads`). `busy_ok`: time on a busy
    machine too, and use what it gives (`hf-mars tune`, asked for by a person who sees the warning; default: the
    `HF_MARS_TIME_BUSY=1` environment variable); otherwise a busy machine is declined (`NotMeasured`) and figures
    found timed busy are saved for no one's choice."""

    def __init__(self, overheads: bool = False, busy_ok: bool | None = None):
        self.overheads = overheads
        self.busy_ok = os.environ.get(TIME_BUSY_ENV) == "1" if busy_ok is None else busy_ok

    def time_passes(self, model, batch: int, key: str, entry: dict, wanted, limit, prefill: bool) -> dict:
        """`entry` (the table's, as far as it is trusted) completed with what `wanted` widths, the steps' overheads
        (if asked) and (with `prefill`) the prompt's forward miss; saved under `key`."""
        self._check_idle(model, key)
        started, forward, untimed = clocks(), costs.forward_costs(entry), entry.get("untimed")
        widths, _, _ = costs.missing_costs(entry, wanted, limit, prefill)
        what = f"{str(model.dtype).removeprefix('torch.')}, batch {batch}"
        logger.warning("MARS: timing pass costs on this machine (%s; once, cached in %s)", what, costs.costs_path())
        if widths:
            forward.update(measure_pass_costs(model, batch, widths, limit=limit, one=forward.get(1), label=what))
            left_out = [w for w in widths if w not in forward]
            untimed = [min(left_out), limit] if left_out else untimed
        overhead, per_token = entry.get("overhead"), entry.get("prefill")
        if self.overheads and overhead is None and not costs.past_limit(forward, costs.OVERHEAD_TREE_WIDTH + 1, limit):
            overhead = measure_overheads(model, batch, forward)
        if prefill and per_token is None:
            per_token = measure_prefill(model, batch) / PREFILL_TOKENS
        timed = {"forward": {str(w): s for w, s in sorted(forward.items())}}
        timed.update({"overhead": overhead} if overhead is not None else {})
        timed.update({"untimed": untimed} if untimed else {})
        timed.update({"prefill": per_token} if per_token is not None else {})
        share = timing_share(started) if model.device.type == "cpu" else 1.0
        _mark_busy(timed, share, entry.get("busy"))
        save(key, timed)
        if share < BUSY_SHARE and not self.busy_ok:
            _DECLINED.add(key)
            raise costs.NotMeasured(f"pass costs of {key} were timed while other work held the CPU")
        return timed

    def _check_idle(self, model, key: str) -> None:
        """Decline (`NotMeasured`) where other work holds cores torch's threads would use: said once, until
        `forget_declined`."""
        if self.busy_ok or model.device.type != "cpu":
            return
        if key in _DECLINED:
            raise costs.NotMeasured(f"pass costs of {key}: the machine was busy")
        busy = busy_cores()
        if busy:
            log = logger.info if _DECLINED else logger.warning  # said once: the other keys quietly
            _DECLINED.add(key)
            log(
                "MARS: other work holds %d of the %d cores torch uses, which puts timings off by up to tens of times: "
                "pass costs not timed now (a later run on an idle machine times them, in seconds); choosing from "
                "what is known of this kind of device.",
                busy,
                torch.get_num_threads(),
            )
            raise costs.NotMeasured(f"pass costs of {key}: the machine is busy")

    def time_compiled(self, model, batch: int, key: str, forward: dict, tree, compile_config) -> dict:
        """`forward` with the compiled pass of `tree` (None: the plain compiled step) timed; saved under `key`."""
        self._check_idle(model, key)
        if not forward:
            logger.warning(
                "MARS: measuring compiled pass costs on this machine (once; cached in %s)", costs.costs_path()
            )
        forward = {**forward, **measure_compiled_passes(model, batch, [tree], compile_config)}
        save(key, {"forward": {str(w): s for w, s in sorted(forward.items())}})
        return forward


def declined() -> set:
    """The cost-table keys this process's timers declined (the machine was busy), since `forget_declined`."""
    return set(_DECLINED)


def forget_declined() -> None:
    """Let timers probe the machine again for the keys they declined (a long-running process, later)."""
    _DECLINED.clear()


def save(key: str, entry: dict | None) -> None:
    """Write one entry of the cost table, or drop it (`None`: timed again next), into the table as it is on disk now
    (another process may have added others)."""
    path = costs.costs_path()
    table = costs.read_table(path)
    if entry is None:
        table.pop(key, None)
    else:
        table[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, sort_keys=True))


def _mark_busy(entry: dict, share: float, before: float | None) -> None:
    """Mark a cache entry timed with `share` of the CPU as busy, below `BUSY_SHARE` (an entry timed busy before stays
    marked as it grows), and say so: no choice reads it, and the next process that finds the machine idle times it
    again."""
    busy = min(share, 1.0 if before is None else before)
    if busy < BUSY_SHARE:
        entry["busy"] = round(busy, 2)
    if share < BUSY_SHARE:
        logger.warning(
            "MARS: other work was running while the pass costs were timed (it left %.0f%% of torch's threads a core "
            "of their own), so they may be far off: not used. A later run on an idle machine times them again (or "
            "`hf-mars tune --refresh-costs`).",
            100 * share,
        )


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
        seconds[1 if tree is None else costs.pass_width(*tree)] = (time.perf_counter() - start) / passes
    return seconds


@torch.no_grad()
def measure_pass_costs(
    model,
    batch_size: int,
    widths,
    context: int = 256,
    repeats: int = 1,
    limit: float | None = None,
    one=None,
    label: str | None = None,
) -> dict[int, float]:
    """Seconds of a forward over each of `widths` new tokens after `context` cached ones, at `batch_size`: the
    fastest of a first round and `repeats` more (a pause of the machine, or a cold first run, lengthens a pass,
    never shortens it).

    Widths are taken in turn, round after round, so that drift (clock, other load) falls on all
    of them alike; `torch.utils.benchmark` times one statement at a time, which would not. At batch > 1 the passes
    carry an attention mask with holes, as batched decoding's do (left-padded prompts): attention without a mask
    takes another path at another speed. `limit` (see `pass_costs`; `one`: a one-token pass's seconds where width 1
    is not among `widths`): the first round goes from narrow to wide and stops at the first width clearly past it;
    the wider ones are left out. `label`: a progress bar, so named, over the rounds.
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
    rounds = tqdm(total=repeats + 1, desc=f"MARS: pass costs ({label})", disable=label is None, leave=False)
    times = {}
    for width in sorted(widths):  # the first round
        seconds = timed(width)
        one = seconds if width == 1 else one
        times[width] = [seconds]
        # 1.25: a margin for a cold first run
        if limit is not None and width > 1 and one is not None and seconds > 1.25 * limit * one:
            break
    rounds.update()
    for _ in range(repeats):
        for width, seconds in times.items():
            seconds.append(timed(width))
        rounds.update()
    rounds.close()
    return {w: min(t) for w, t in times.items()}


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
        "mars_overhead": max(0.0, per_step[False] - forward[costs.OVERHEAD_TREE_WIDTH]),
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
