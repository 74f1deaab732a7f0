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
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import GenerationMixin

from ..decoding.compat import CACHE_ARG
from ..decoding.generate import mars_settings
from .trees import TUNE_TREES, tree_name


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
        _sync(self.model)
        self._start = time.perf_counter()

    def _exit(self, *args):
        _sync(self.model)
        self.seconds += time.perf_counter() - self._start
        self.count += 1

    def reset(self):
        self.count, self.seconds = 0, 0.0

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []


def generate_ar(model, **inputs):
    """Plain greedy `generate()` of transformers (the reference): `(sequences, None)`."""
    return GenerationMixin.generate(model, do_sample=False, **inputs), None


def static_compiled(model, longest_prompt: int, max_new_tokens: int, batch_sizes, trees=()) -> dict:
    """`generate()` kwargs for a static cache and `generate()`'s compile path, for plain decoding and MARS alike.

    `max_cache_len` is the most slots any method here needs (τ-mode, the default lossless tree, `trees`), so every
    method's cache has one size and nothing recompiles for a longer prompt. On a GPU `generate()` compiles with its
    default `CompileConfig` (CUDA graphs); elsewhere it is told to compile all the same.
    """
    from transformers import CompileConfig

    calls = [dict(mars_tau=0.5), dict(mars_verify=True)]
    calls += [
        dict(mars_verify=True, mars_block_size=b, mars_draft_candidates=n, mars_lookup=lookup)
        for b, n, lookup in trees
    ]
    slots = max(
        model.mars_cache_length(longest_prompt, max_new_tokens, batch, **call)
        for batch in batch_sizes
        for call in calls
    )
    kwargs = dict(cache_implementation="static", max_cache_len=slots)
    if model.device.type != "cuda":
        kwargs["compile_config"] = CompileConfig(mode="default")
        kwargs["compile_config"]._compile_all_devices = True  # generate()'s own switch for compiling off a GPU
    return kwargs


def generate_mars(model, tau, verify=False, mask_cost=0.0, block_size=None, candidates=None, lookup=None, **inputs):
    """Greedy MARS decoding: `(sequences, row_passes)`. `None`: the model's default (lossless: its `mars_lossless`)."""
    out = model.generate(
        mars_tau=tau,
        mars_verify=verify,
        mars_mask_cost=mask_cost,
        mars_block_size=block_size,
        mars_draft_candidates=candidates,
        mars_lookup=lookup,
        do_sample=False,
        return_dict_in_generate=True,
        **inputs,
    )
    return out.sequences, int(out.mars_stats.passes_per_row.sum())


def methods(
    taus,
    verify: bool,
    prompt_lookup: int,
    mask_costs=(0.0,),
    measured: dict | None = None,
    trees=(),
    tau_mode: bool = True,
    extra: dict | None = None,
) -> dict:
    """Name -> function(model, counter, **inputs) returning `(sequences, row_passes)`.

    MARS methods are named "mars tau=0.9" and "lossless tau=0.9" (B-1 masks every pass; lossless mode's tree is the
    model's default, i.e. its generation config's `mars_lossless` if any), or "mars cost=0.18 tau=0.9"
    and "lossless cost=0.18 tau=0.9" with `mars_mask_cost=0.18`; "cost=auto" uses `measured["auto"]`, which
    `run_benchmark` sets to `measure_mask_cost` at each batch size. `row_passes` sums, over rows, the forward passes
    each row took part in until it finished: tokens per forward is generated tokens / row_passes (1.0 for AR by
    definition, where it is None; MARS reports it in `mars_stats`). Each `(B, n, L)` of `trees` adds lossless methods
    "lossless B=2 n=3 L=4 tau=0.0" with `mars_block_size=B, mars_draft_candidates=n, mars_lookup=L` (no "L=" when
    L is 0). `tau_mode=False` leaves out the "mars" (τ-mode) methods. `extra`: more `generate()` kwargs for plain
    decoding and MARS (e.g. `static_compiled`'s), not for prompt lookup.
    """
    extra = extra or {}

    def ar(model, counter, **kw):
        return generate_ar(model, **extra, **kw)

    def lookup(model, counter, **kw):
        with counter.hooked():
            out = GenerationMixin.generate(model, do_sample=False, prompt_lookup_num_tokens=prompt_lookup, **kw)
        return out, counter.count * out.shape[0]

    def mars(model, counter, tau, verify=False, cost=0.0, block=None, candidates=None, lookup=None, **kw):
        if cost == "auto":
            mars = dict(mars_tau=tau, mars_verify=verify, mars_block_size=block)
            cost = auto_mask_cost(model, kw["input_ids"].shape[0], measured["auto"], **mars)
        return generate_mars(model, tau, verify, cost, block, candidates, lookup, **extra, **kw)

    table = {"ar": ar}
    if prompt_lookup:
        table["prompt-lookup"] = lookup
    for tau in taus:
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
                    table[f"lossless{suffix} {tree_name(block, n, lookup)} tau={tau}"] = (
                        lambda m, c, tau=tau, cost=cost, b=block, n=n, L=lookup, **kw: mars(
                            m, c, tau, verify=True, cost=cost, block=b, candidates=n, lookup=L, **kw
                        )
                    )
    return table


def tune_lossless(
    model,
    tokenizer,
    prompts,
    trees=TUNE_TREES,
    taus=(0.0,),
    batch_size: int = 1,
    max_new_tokens: int = 96,
    repeats: int = 1,
    progress: bool = True,
) -> tuple[dict, Cell, list[Cell]]:
    """Find the fastest lossless draft tree for this model and machine: `(best, fastest, cells)`.

    Runs plain `generate()` and lossless mode with the model's current default tree and with each `(B, n, L)` of
    `trees` at each τ, on `prompts`, at `batch_size`, side by side (`run_benchmark`, mask cost 0). `best` is the
    `mars_lossless` entry of the fastest (`save_lossless_preset` writes it into a checkpoint for that batch size, where
    `generate(mars_verify=True)` reads it), `fastest` its measurement, `cells` all of them, to print. Lossless mode's
    text is the same for every tree (up to rounding), so speed alone decides.
    """
    cells = run_benchmark(
        model,
        tokenizer,
        prompts,
        taus=taus,
        batch_sizes=(batch_size,),
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        verify=True,
        prompt_lookup=0,
        mask_costs=(0.0,),
        progress=progress,
        trees=trees,
        tau_mode=False,
    )
    presets, keys = {}, ("mars_tau", "mars_block_size", "mars_draft_candidates", "mars_lookup")
    for tau in taus:
        default = mars_settings(model, None, batch_size, mars_tau=tau, mars_verify=True)
        presets[f"lossless tau={tau}"] = {key: default[key] for key in keys}
        for block, n, lookup in trees:
            presets[f"lossless {tree_name(block, n, lookup)} tau={tau}"] = dict(
                mars_tau=tau, mars_block_size=block, mars_draft_candidates=n, mars_lookup=lookup
            )
    fastest = max((c for c in cells if c.method in presets), key=lambda c: c.speedup)
    return presets[fastest.method], fastest, cells


def save_lossless_preset(folder: str | Path, preset: dict, batch_size: int = 1) -> Path:
    """Write `preset` into the checkpoint folder's generation config as `mars_lossless`'s entry for `batch_size`: its
    lossless defaults from that batch size up. Entries for other batch sizes stay; a flat one counts as batch 1's."""
    from transformers import GenerationConfig

    folder = Path(folder)
    if not (folder / "generation_config.json").is_file():
        raise FileNotFoundError(f"{folder} has no generation_config.json: pass a local MARS checkpoint folder.")
    config = GenerationConfig.from_pretrained(folder)
    entries = getattr(config, "mars_lossless", None) or {}
    if entries and not all(str(key).isdigit() for key in entries):
        entries = {"1": entries}
    config.mars_lossless = {**entries, str(batch_size): dict(preset)}
    config.save_pretrained(folder)
    return folder / "generation_config.json"


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
) -> list[Cell]:
    """Run every method at every batch size on `prompts`; return one `Cell` each (see the module docstring).

    `mask_costs`: values of `mars_mask_cost` to measure (0: B-1 masks every pass; "auto": the cost at each batch size,
    from `measured_costs` (batch size -> `measure_mask_cost`) or measured here); each adds MARS and lossless cells.
    `trees`: `(B, n, L)` lossless draft trees to measure besides the default (see `methods`); `tau_mode=False`: no
    τ-mode cells. `compiled`: a static cache and `torch.compile` for plain decoding and MARS (`static_compiled`).
    """
    from tqdm.auto import tqdm

    measured = {}  # "auto": the mask cost at the batch size being run, read by the "cost=auto" methods
    extra = None
    if compiled:
        longest = max(len(tokenizer(p["text"], add_special_tokens=False).input_ids) for p in prompts)
        extra = static_compiled(model, longest, max_new_tokens, batch_sizes, trees)
    table = methods(taus, verify, prompt_lookup, mask_costs, measured, trees, tau_mode, extra)
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
            batches = [prompts[i : i + batch_size] for i in range(0, len(prompts) - batch_size + 1, batch_size)]
            if not batches:
                raise ValueError(f"{len(prompts)} prompts are too few for batch size {batch_size}.")
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
            cells += _cells(table, batch_size, batches, tally)
    finally:
        counter.remove()
        bar.close()
    return cells


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
        _sync(model)
        counter.reset()
        start = time.perf_counter()
        sequences, row_passes = run(model, counter, **inputs, max_new_tokens=max_new_tokens)
        _sync(model)
        tally.add_time(name, time.perf_counter() - start, counter.seconds)
        if repeat == 0:
            generated = sequences[:, inputs["input_ids"].shape[1] :]
            new = count_new_tokens(generated, tokenizer, eos_token_ids(model, tokenizer))
            tally.tokens[name] += new
            tally.passes[name] += new if row_passes is None else row_passes
            tally.outputs[name] += tokenizer.batch_decode(generated, skip_special_tokens=True)
        bar.update(1)


def auto_mask_cost(model, batch_size: int = 1, measured: list[float] | None = None, **mars_kwargs) -> list[float]:
    """`mars_mask_cost="auto"` resolved for a call with these `mars_*` kwargs: the cost of 1 .. B-1 masks measured
    on this machine (`measured`, else `measure_mask_cost` now) for the model's own B, cut to the B this call runs
    with, which may be smaller."""
    costs = measured if measured is not None else measure_mask_cost(model, batch_size)
    kwargs = {key: value for key, value in mars_kwargs.items() if key != "mars_mask_cost"}
    return costs[: mars_settings(model, None, batch_size, **kwargs)["mars_block_size"] - 1]


def measure_mask_cost(model, batch_size: int = 1, context: int = 256, repeats: int = 7) -> list[float]:
    """What masks add to the time of a decoding pass on this model and machine: `mars_mask_cost` as a list.

    Times forwards over 1 to B tokens (B = the model's block size) after `context` cached tokens, `repeats` times each
    in alternation, and returns, for k = 1 .. B-1 masks, `median(t_{k+1}) / median(t_1) - 1`. Measured, not assumed:
    the cost depends on the dtype's matrix kernels (a pass over a few rows may cost as much as over eight, or a pass
    over 2 tokens more than over 4) and so differs between machines.

    At batch > 1 the passes carry an attention mask with holes, as batched decoding's do (left-padded prompts, rows
    that accepted fewer tokens): attention without a mask takes another path at another speed, so timing it would
    misjudge what decoding pays.
    """
    from transformers import DynamicCache

    block = int(model.config.mars_block_size)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (batch_size, context + block), device=model.device)
    real = torch.ones_like(ids)
    real[1::2, : max(1, context // 8)] = 0  # every other row left-padded, as in a batch of unequal prompts

    def mask(end: int):
        return real[:, :end] if batch_size > 1 else None

    cache = DynamicCache(config=model.config)
    times = {width: [] for width in range(1, block + 1)}
    with torch.no_grad():
        model(input_ids=ids[:, :context], attention_mask=mask(context), **{CACHE_ARG: cache}, use_cache=True)
        for _ in range(repeats + 1):  # the first round warms up
            for width in times:
                _sync(model)
                start = time.perf_counter()
                model(
                    input_ids=ids[:, context : context + width],
                    attention_mask=mask(context + width),
                    **{CACHE_ARG: cache},
                    use_cache=True,
                    logits_to_keep=width,
                )
                _sync(model)
                times[width].append(time.perf_counter() - start)
                cache.crop(-width)
    one = statistics.median(times[1][1:])
    return [round(max(0.0, statistics.median(times[w][1:]) / one - 1), 3) for w in range(2, block + 1)]


def _sync(model):
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def eos_token_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    return [ids] if isinstance(ids, int) else list(ids or [tokenizer.eos_token_id])


def count_new_tokens(generated, tokenizer, eos_ids) -> int:
    """Generated tokens up to and including each row's first EOS (rows that stopped early are right-padded).

    Counting non-pad tokens instead would miss the EOS where it doubles as the pad token (SmolLM2, Qwen).
    """
    width = generated.shape[1]
    slot = torch.arange(width, device=generated.device)
    ends = (
        torch.isin(generated, torch.tensor(eos_ids, device=generated.device))
        if eos_ids
        else torch.zeros_like(generated, dtype=torch.bool)
    )
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id not in eos_ids:
        ends |= torch.cat(
            [generated[:, 1:] == tokenizer.pad_token_id, torch.zeros_like(generated[:, :1], dtype=torch.bool)], dim=1
        )
    # A row ends at its first EOS, or just before its right padding; rows with neither ran to max_new_tokens
    last = torch.where(ends, slot, width).min(dim=1).values
    return int(torch.clamp(last + 1, max=width).sum())


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
    from .plots import save_figure, tau_figure

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
