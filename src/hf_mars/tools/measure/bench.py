"""Speed benchmark: MARS against plain autoregressive decoding and prompt-lookup decoding, side by side.

Every method runs on the same model, dtype and attention implementation, in one process, in alternating order
(each repeat runs all methods on a batch before the next batch), after a warm-up; figures are medians over repeats.
Forward passes are counted with a hook on the model, the same way for every method.

Per cell (method x batch size): tokens per forward, tokens/s, speed-up over AR, efficiency = speed-up / tokens per
forward (1.0 means every extra accepted token came for free), agreement with the AR outputs, and accuracy when the
prompts carry answers.

`compiled=True` runs plain `generate()` and MARS the way a GPU server runs a small model: a static cache and
`generate()`'s own `torch.compile` path (`static_compiled`), warmed up on the longest batch first, so compilation
stays out of the timings. Prompt lookup stays on its dynamic cache (transformers' assisted decoding).

`decoding`: `generate()` kwargs every method runs with: sampling (e.g. `dict(do_sample=True, temperature=0.7)`:
each run from the same seed; agreement then compares draws, not greedy texts), a repetition penalty.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import GenerationMixin

from ...decoding.costs import tree_key
from .calibrate import auto_mask_cost, measure_mask_cost
from .decode import compiled_path, count_new_tokens, eos_token_ids, generate_ar, generate_mars, static_compiled
from .passes import measure, sync
from .plots import save_figure, tau_figure


@dataclass
class Cell:
    method: str
    batch_size: int
    tokens_per_forward: float
    tokens_per_second: float
    speedup: float = 1.0
    efficiency: float = 1.0
    agreement: float | None = None  # share of outputs identical to plain AR greedy
    accuracy: float | None = None
    forward_share: float | None = None  # time inside the model's forward / total time; the rest is overhead


class ForwardCounter:
    """Counts the model's forward passes and the time spent inside them (hooks, the same for every method).

    The time outside the forward (token choice and acceptance, cache bookkeeping, the Python loop) is a method's
    overhead. On CUDA the hooks synchronize, so that the split is real (it costs the methods alike). A compiled
    forward cannot carry hooks (they break its graph): with `always=False` they are only on within `hooked()`.
    """

    def __init__(self, model, always: bool = True):
        self.count, self.seconds, self._start = 0, 0.0, 0.0
        self.model, self.handles = model, []
        if always:
            self._hook()

    def _hook(self):
        self.handles = [
            self.model.register_forward_pre_hook(self._enter),
            self.model.register_forward_hook(self._exit),
        ]

    @contextlib.contextmanager
    def hooked(self):
        """Count the forwards of this block even where the hooks are otherwise off."""
        added = not self.handles
        if added:
            self._hook()
        try:
            yield self
        finally:
            if added:
                self.remove()

    def _enter(self, *args):
        sync(self.model)
        self._start = time.perf_counter()

    def _exit(self, *args):
        sync(self.model)
        self.seconds += time.perf_counter() - self._start
        self.count += 1

    def reset(self):
        self.count, self.seconds = 0, 0.0

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []


def methods(
    taus,
    verify: bool,
    prompt_lookup: int,
    mask_costs=(0.0,),
    measured: dict | None = None,
    trees=(),
    tau_mode: bool = True,
    extra: dict | None = None,
    decoding: dict | None = None,
    lossless_taus=None,
) -> dict:
    """Name -> function(model, counter, **inputs) returning `(sequences, row_passes)`.

    MARS methods are named "mars tau=0.9" and "lossless tau=0.9" (B-1 masks every pass; lossless mode's tree is the
    model's default, i.e. its generation config's `mars_lossless` if any), or "mars cost=0.18 tau=0.9"
    and "lossless cost=0.18 tau=0.9" with `mars_mask_cost=0.18`; "cost=auto" uses `measured["auto"]`, which
    `run_benchmark` sets to `measure_mask_cost` at each batch size. `row_passes` sums, over rows, the forward passes
    each row took part in until it finished: tokens per forward is generated tokens / row_passes (1.0 for AR by
    definition, where it is None; MARS reports it in `mars_stats`). Each `(B, n, L)` of `trees` adds lossless methods
    named by `costs.tree_key`, "lossless 2x3+4 tau=0.0", with `mars_block_size=B, mars_draft_candidates=n,
    mars_lookup=L`. `tau_mode=False` leaves out the "mars" (τ-mode) methods. `extra`: more `generate()` kwargs for
    plain decoding and MARS (e.g. `static_compiled`'s), not for prompt lookup; `decoding`: for every method (a
    repetition penalty; see `run_benchmark`). `lossless_taus`: the τs of the lossless methods (None: `taus`).
    """
    extra = (decoding or {}) | (extra or {})

    def ar(model, counter, **kw):
        return generate_ar(model, **extra, **kw)

    def lookup(model, counter, **kw):
        with counter.hooked():
            greedy = dict(do_sample=False, prompt_lookup_num_tokens=prompt_lookup)
            out = GenerationMixin.generate(model, **(decoding or {}), **greedy, **kw)
        return out, counter.count * out.shape[0]

    def mars(model, counter, tau, verify=False, cost=0.0, block=None, candidates=None, lookup=None, **kw):
        if cost == "auto":
            mars = dict(mars_tau=tau, mars_verify=verify, mars_block_size=block)
            cost = auto_mask_cost(model, kw["input_ids"].shape[0], measured["auto"], **mars)
        return generate_mars(model, tau, verify, cost, block, candidates, lookup, **extra, **kw)

    table = {"ar": ar}
    if prompt_lookup:
        table["prompt-lookup"] = lookup
    lossless_taus = taus if lossless_taus is None else lossless_taus
    return table | _mars_methods(mars, taus if tau_mode else (), mask_costs, lossless_taus if verify else (), trees)


def _mars_methods(mars, taus, mask_costs, lossless_taus, trees) -> dict:
    """The MARS and lossless entries of `methods`' table: `mars` with one τ, mask cost and draft tree bound each;
    τ-mode at each of `taus`, lossless mode at each of `lossless_taus`."""
    table = {}
    for tau in dict.fromkeys([*taus, *lossless_taus]):
        tau_mode, verify = tau in taus, tau in lossless_taus
        for cost in mask_costs:
            suffix = f" cost={cost}" if cost else ""
            if tau >= 1.0 and suffix:  # no mask is fed at τ = 1: the cost changes nothing
                continue
            if tau_mode:
                table[f"mars{suffix} tau={tau}"] = lambda m, c, tau=tau, cost=cost, **kw: mars(
                    m, c, tau, cost=cost, **kw
                )
            if verify:
                table[f"lossless{suffix} tau={tau}"] = lambda m, c, tau=tau, cost=cost, **kw: mars(
                    m, c, tau, verify=True, cost=cost, **kw
                )
                for block, n, lookup in trees if tau < 1.0 else ():
                    table[f"lossless{suffix} {tree_key(block, n, lookup)} tau={tau}"] = (
                        lambda m, c, tau=tau, cost=cost, b=block, n=n, L=lookup, **kw: mars(
                            m, c, tau, verify=True, cost=cost, block=b, candidates=n, lookup=L, **kw
                        )
                    )
    return table


def run_benchmark(
    model,
    tokenizer,
    prompts: list[dict],
    taus=(1.0, 0.95, 0.9, 0.8, 0.7),
    batch_sizes=(1, 4, 8, 16),
    max_new_tokens: int = 128,
    repeats: int = 3,
    verify: bool = True,
    prompt_lookup: int = 10,
    mask_costs=(0.0, "auto"),
    measured_costs: dict | None = None,
    progress: bool = True,
    trees=(),
    tau_mode: bool = True,
    compiled: bool = False,
    decoding: dict | None = None,
    lossless_taus=None,
) -> list[Cell]:
    """Run every method at every batch size on `prompts`; return one `Cell` each (see the module docstring).

    `mask_costs`: values of `mars_mask_cost` to measure (0: B-1 masks every pass; "auto": the cost at each batch size,
    from `measured_costs` (batch size -> `measure_mask_cost`) or measured here); each adds MARS and lossless cells.
    `trees`: `(B, n, L)` lossless draft trees to measure besides the default (see `methods`); `tau_mode=False`: no
    τ-mode cells. `compiled`: a static cache and `torch.compile` for plain decoding and MARS (`static_compiled`).
    `decoding`: `generate()` kwargs of how every method decodes (sampling, a repetition penalty; no prompt lookup
    with sampling: it is measured greedy). `lossless_taus`: the τs lossless mode runs at (None: `taus`).
    """
    decoding = dict(decoding or {})
    if decoding.get("do_sample") and prompt_lookup:
        raise ValueError("Prompt lookup is measured greedy: pass prompt_lookup=0 when sampling.")

    measured = {}  # "auto": the mask cost at the batch size being run, read by the "cost=auto" methods
    extra = {}
    if compiled:
        longest = max(len(tokenizer(p["text"], add_special_tokens=False).input_ids) for p in prompts)
        extra = static_compiled(model, longest, max_new_tokens, batch_sizes, trees)
    table = methods(taus, verify, prompt_lookup, mask_costs, measured, trees, tau_mode, extra, decoding, lossless_taus)
    tokenizer.padding_side = "left"
    counter = ForwardCounter(model, always=not compiled)
    cells = []
    total = sum(len(table) * repeats * max(1, len(prompts) // b) for b in batch_sizes)
    bar = tqdm(total=total, desc="benchmark", disable=not progress)
    try:
        for batch_size in batch_sizes:
            if "auto" in mask_costs:
                known = (measured_costs or {}).get(batch_size)
                measured["auto"] = known if known is not None else measure_mask_cost(model, batch_size)
            if verify:  # lossless "auto" picks its tree from this machine's pass costs, on the path the runs take
                measure(model, [batch_size], mars_verify=True, **(compiled_path(model) if compiled else {}))
            batches = _batches(prompts, batch_size)
            tally = _repeat_batches(model, tokenizer, table, counter, batches, repeats, max_new_tokens, bar, compiled)
            cells += _cells(table, batch_size, batches, tally)
    finally:
        counter.remove()
        bar.close()
    return cells


def _batches(prompts: list[dict], batch_size: int) -> list[list[dict]]:
    """`prompts` in full batches of `batch_size` (a last, smaller one is left out: every cell runs one batch size)."""
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts) - batch_size + 1, batch_size)]
    if not batches:
        raise ValueError(f"{len(prompts)} prompts are too few for batch size {batch_size}.")
    return batches


def _repeat_batches(model, tokenizer, table, counter, batches, repeats, max_new_tokens, bar, compiled) -> _Tally:
    """Every method on every batch, `repeats` times (all methods on a batch before the next batch), timed into a
    `_Tally`; each method is warmed up on the first batch before its first timing."""
    tally = _Tally(table)
    for repeat in range(repeats):
        for batch in batches:
            _run_batch(
                model,
                tokenizer,
                table,
                counter,
                batch,
                tally,
                repeat,
                max_new_tokens,
                bar,
                warm_up=repeat == 0 and batch is batches[0],
                warm_up_tokens=max_new_tokens if compiled else 8,  # compile every shape before timing
            )
        tally.end_repeat()
    return tally


class _Tally:
    """What a batch size's runs add up to, per method: seconds and seconds inside the forward per repeat; tokens,
    row passes and decoded outputs of the first repeat (the later ones decode the same)."""

    def __init__(self, table):
        self.seconds = {name: [] for name in table}
        self.in_forward = {name: [] for name in table}
        self.tokens = dict.fromkeys(table, 0)
        self.passes = dict.fromkeys(table, 0)
        self.outputs = {name: [] for name in table}
        self._repeat = dict.fromkeys(table, 0.0)
        self._repeat_forward = dict.fromkeys(table, 0.0)

    def add_time(self, name: str, seconds: float, in_forward: float) -> None:
        self._repeat[name] += seconds
        self._repeat_forward[name] += in_forward

    def end_repeat(self) -> None:
        for name in self.seconds:
            self.seconds[name].append(self._repeat[name])
            self.in_forward[name].append(self._repeat_forward[name])
        self._repeat = dict.fromkeys(self._repeat, 0.0)
        self._repeat_forward = dict.fromkeys(self._repeat_forward, 0.0)


def _run_batch(
    model, tokenizer, table, counter, batch, tally, repeat, max_new_tokens, bar, warm_up, warm_up_tokens=8
) -> None:
    """Every method on one batch, in turn (so that drift in machine load hits all alike), timed into `tally`."""
    inputs = tokenizer([p["text"] for p in batch], return_tensors="pt", padding=True, add_special_tokens=False)
    inputs = inputs.to(model.device)
    for name, run in table.items():
        if name == "prompt-lookup" and len(batch) > 1:  # transformers runs it at batch size 1 only
            bar.update(1)
            continue
        if warm_up:
            run(model, counter, **inputs, max_new_tokens=warm_up_tokens)
        sync(model)
        counter.reset()
        torch.manual_seed(repeat)  # every method draws from the same seed (sampling)
        start = time.perf_counter()
        sequences, row_passes = run(model, counter, **inputs, max_new_tokens=max_new_tokens)
        sync(model)
        tally.add_time(name, time.perf_counter() - start, counter.seconds)
        if repeat == 0:
            generated = sequences[:, inputs["input_ids"].shape[1] :]
            new = count_new_tokens(generated, tokenizer, eos_token_ids(model, tokenizer))
            tally.tokens[name] += new
            tally.passes[name] += new if row_passes is None else row_passes
            tally.outputs[name] += tokenizer.batch_decode(generated, skip_special_tokens=True)
        bar.update(1)


def _cells(table, batch_size, batches, tally: _Tally) -> list[Cell]:
    checks = [p["check"] for batch in batches for p in batch]
    seconds, tokens, passes, outputs = tally.seconds, tally.tokens, tally.passes, tally.outputs
    ar_speed = tokens["ar"] / statistics.median(seconds["ar"])
    cells = []
    for name in table:
        if not passes[name]:  # not run at this batch size
            continue
        per_forward = tokens[name] / passes[name]
        speed = tokens[name] / statistics.median(seconds[name])
        cell = Cell(name, batch_size, per_forward, speed, speed / ar_speed, speed / ar_speed / per_forward)
        in_forward = sum(tally.in_forward[name])
        cell.forward_share = in_forward / sum(seconds[name]) if in_forward else None  # None: compiled, not hooked
        cell.agreement = sum(a == b for a, b in zip(outputs[name], outputs["ar"])) / len(outputs["ar"])
        if all(check is not None for check in checks):
            cell.accuracy = sum(check(o) for check, o in zip(checks, outputs[name])) / len(checks)
        cells.append(cell)
    return cells


def format_table(cells: list[Cell]) -> str:
    name = max([26] + [len(c.method) for c in cells])
    head = (
        f"{'method':<{name}} {'batch':>5} {'tok/fwd':>8} {'tok/s':>9} {'speed-up':>9} {'efficiency':>10} {'= AR':>6} "
        f"{'acc':>6} {'in fwd':>7}"
    )
    lines = [head, "-" * len(head)]
    for c in cells:
        acc = "" if c.accuracy is None else f"{c.accuracy:.0%}"
        share = "" if c.forward_share is None else f"{c.forward_share:.0%}"
        lines.append(
            f"{c.method:<{name}} {c.batch_size:>5} {c.tokens_per_forward:>8.2f} {c.tokens_per_second:>9.1f} "
            f"{c.speedup:>8.2f}x {c.efficiency:>10.2f} {c.agreement:>6.0%} {acc:>6} {share:>7}"
        )
    return "\n".join(lines)


def save(
    cells: list[Cell], json_path: str | Path, png_path: str | Path | None = None, meta: dict | None = None
) -> None:
    """Write the cells as JSON, and a PNG: tokens/forward and speed-up against τ, one line per batch size."""
    Path(json_path).write_text(json.dumps({"meta": meta or {}, "cells": [asdict(c) for c in cells]}, indent=2))
    if png_path is None:
        return

    plt, fig, axes = tau_figure(
        ["tokens per forward", "speed-up over AR generate()"], "The benchmark's plot needs matplotlib"
    )
    prefixes = sorted({c.method.split(" tau=")[0] for c in cells if " tau=" in c.method})
    for prefix in prefixes:
        style = ("--" if prefix.startswith("lossless") else "-") + ("o" if "cost" not in prefix else "^")
        for batch_size in sorted({c.batch_size for c in cells}):
            row = sorted(
                (float(c.method.split(" tau=")[1]), c)
                for c in cells
                if c.method.split(" tau=")[0] == prefix and c.batch_size == batch_size
            )
            if not row:
                continue
            taus = [t for t, _ in row]
            axes[0].plot(taus, [c.tokens_per_forward for _, c in row], style, label=f"{prefix} batch {batch_size}")
            axes[1].plot(taus, [c.speedup for _, c in row], style, label=f"{prefix} batch {batch_size}")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[0].legend(fontsize=7)
    save_figure(plt, fig, png_path)
