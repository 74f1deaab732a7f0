"""A CPU proxy for what a MARS pass costs on a GPU: a thin, deep random model on one thread.

A 135M model on a GPU is host-bound: Python and kernel launches, not arithmetic, set the time of a step. A random
Llama with many thin layers on one CPU thread is host-bound the same way, so what a MARS pass costs beyond a plain
decoding step (its bookkeeping, its wider forward) shows here without a GPU. Random weights accept almost nothing,
which is beside the point: the figure is the time of a pass against the time of a plain step.

With `compiled=True` both run as a GPU server runs them: a static cache and `generate()`'s `torch.compile` path
(`bench.static_compiled`); then the figure is what MARS adds to a step once Python is compiled away.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, GenerationMixin, LlamaConfig

from ...convert import to_mars
from ...decoding import graph_state
from ...decoding.cache import StaticMARSCache
from ...decoding.runner import rows_cache
from ...decoding.tree import NO_DRAFTS, tree_attention
from ..checkpoints.toy import toy_tokenizer
from .calibrate import auto_mask_cost, measure_mask_cost
from .decode import static_compiled
from .tables import markdown_table

# What each mode is run with (eos_token_id=None: every row decodes max_new_tokens, so all modes do the same work)
MODES = {
    "MARS τ = 1": dict(mars_tau=1.0),
    "MARS τ = 0.9": dict(mars_tau=0.9),
    "MARS τ = 0.9, measured mask cost": dict(mars_tau=0.9, mars_mask_cost="auto"),  # masks fed only where they pay
    "lossless": dict(mars_verify=True, mars_tau=0.9),
    "lossless, prompt lookup 4": dict(mars_verify=True, mars_tau=0.9, mars_lookup=4),  # the shipped trees' branch
}


def host_bound_model(layers: int = 30, hidden: int = 64, seed: int = 0):
    """`(model, tokenizer)`: a random `layers`-deep Llama of width `hidden`, made MARS (B = 4), float32."""

    tokenizer = toy_tokenizer()
    config = LlamaConfig(
        vocab_size=272,  # the toy tokenizer and a spare row for <|mask|>
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    return to_mars(model, tokenizer, block_size=4), tokenizer


def pass_costs(
    model, tokenizer, batch_sizes=(1, 4), max_new_tokens: int = 48, repeats: int = 5, compiled: bool = False
) -> list[dict]:
    """ms per plain `generate()` step and ms per MARS pass in each mode, side by side in one run: the modes take
    turns within each repeat (so a busy machine slows them alike) and the median repeat counts."""

    rows = []
    for batch in batch_sizes:
        inputs = tokenizer(["hello world, how are you"] * batch, return_tensors="pt")
        prompt = inputs.input_ids.shape[1]
        extra = static_compiled(model, prompt, max_new_tokens, batch_sizes, _trees(model)) if compiled else {}
        seconds, passes = _time_modes(model, inputs, max_new_tokens, repeats, extra)
        step = seconds["plain generate()"] / max_new_tokens
        for name, total in seconds.items():
            per_pass = total / passes[name]
            rows.append(dict(batch=batch, method=name, ms=1000 * per_pass, ratio=per_pass / step))
    return rows


def _trees(model) -> list[tuple]:
    """The lossless trees of `MODES` that widen a pass beyond the default chain, as `static_compiled` takes them, so
    that one static cache holds every mode's passes (a mode that outgrew it would make every later call recompile)."""
    block = model.config.mars_block_size
    return [
        (block, mode.get("mars_draft_candidates", 1), mode["mars_lookup"])
        for mode in MODES.values()
        if mode.get("mars_lookup")
    ]


def _resolved(model, batch: int, mars: dict, measured: dict) -> dict:
    """`mars` with a mask cost of `"auto"` measured on this model at this batch size, once per batch size (kept in
    `measured`): every call it is passed to feeds masks by the same costs (a second timing, on a busy machine, may
    feed different ones and so run different passes)."""
    if mars.get("mars_mask_cost") != "auto":
        return mars
    if batch not in measured:
        measured[batch] = measure_mask_cost(model, batch)
    return {**mars, "mars_mask_cost": auto_mask_cost(model, batch, measured[batch], **mars)}


def _time_modes(model, inputs, max_new_tokens: int, repeats: int, extra: dict) -> tuple[dict, dict]:
    """Median seconds of a whole generation, and its forward passes, for plain `generate()` and each MARS mode. Every
    run is called alike, for the sequences alone; the first run of each (not timed: it compiles what it compiles)
    returns MARS's stats too, which count its passes (greedy without EOS: the same in every run)."""

    kwargs = dict(**inputs, max_new_tokens=max_new_tokens, eos_token_id=None, **extra)
    runs = {"plain generate()": functools.partial(GenerationMixin.generate, model, do_sample=False, **kwargs)}
    measured = {}
    for name, mars in MODES.items():
        mars = _resolved(model, inputs.input_ids.shape[0], mars, measured)
        runs[name] = functools.partial(model.generate, **mars, **kwargs)
    times, passes = {name: [] for name in runs}, {}
    with torch.no_grad():
        for name, run in runs.items():  # warm-up, which counts the passes (plain's: one a token)
            stats = getattr(run(return_dict_in_generate=True), "mars_stats", None)
            passes[name] = max_new_tokens if stats is None else stats.forward_passes
        for _ in range(repeats):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}, passes


def forward_costs(model, batch: int = 1, widths=(1, 2, 4, 7), context: int = 24, repeats: int = 30) -> dict:
    """ms of the model's forward alone over `width` new tokens after `context` cached ones, on a runner's static
    cache with the attention mask a MARS pass builds (the slot map for one token, as a plain step takes it): the floor
    under what a pass of that width can cost, whatever the decoding around it does. Widths take turns; medians."""

    ids = torch.full((batch, context + max(widths)), 7)
    cache = StaticMARSCache(rows_cache(model, batch, context + max(widths)), batch, ids.device)
    times = {width: [] for width in widths}
    with torch.no_grad():
        mask, positions = cache.step_inputs(torch.ones(batch, context, dtype=torch.bool), 0)
        model(input_ids=ids[:, :context], attention_mask=mask, position_ids=positions, **cache.forward_kwargs(context))
        cache.commit(torch.ones(batch, context, dtype=torch.bool), 0)
        for _ in range(repeats + 1):  # the first round warms up
            for width in widths:
                start = time.perf_counter()
                mask, positions = cache.step_inputs(torch.ones(batch, width, dtype=torch.bool), 0)
                if width > 1:
                    mask = tree_attention(model, cache, NO_DRAFTS, mask, width, 0)
                kwargs = dict(attention_mask=mask, position_ids=positions, logits_to_keep=width)
                model(input_ids=ids[:, context : context + width], **cache.forward_kwargs(width), **kwargs)
                times[width].append(time.perf_counter() - start)
                cache.commit(torch.zeros(batch, 0, dtype=torch.bool), width)  # the layers step back over the pass
    return {width: 1000 * statistics.median(t[1:]) for width, t in times.items()}


# How `host_ops` decodes, plain and MARS alike: each mode's pass against the plain step of the same decoding
DECODINGS = {
    "greedy": dict(do_sample=False),
    "sampled (T = 0.7, top-k 50)": dict(do_sample=True, temperature=0.7, top_k=50, top_p=1.0),
    "greedy, repetition penalty 1.2": dict(do_sample=False, repetition_penalty=1.2),
    "sampled, repetition penalty 1.2": dict(
        do_sample=True, temperature=0.7, top_k=50, top_p=1.0, repetition_penalty=1.2
    ),
    "greedy, no_repeat_ngram_size 3": dict(do_sample=False, no_repeat_ngram_size=3),
}


def host_ops(
    model, tokenizer, batch_sizes=(1, 4), max_new_tokens: int = 48, decodings=("greedy",), default=()
) -> list[dict]:
    """aten ops dispatched outside the model's forward, per plain `generate()` step and per MARS pass, with a static
    cache, eager: what a GPU's host launches around the forward. Each MARS mode runs in its runner's graph pass, in
    each of `decodings` (`DECODINGS`' names), against the plain step of the same decoding; the prompt's pass counts
    with the rest. Both are called alike, returning the sequences alone (`return_dict_in_generate` would add, once per
    run, the building of the returned cache, which MARS gathers from its own). The decodings in `default` run as the
    default call too (no cache argument: MARS's eager runner on a static cache of its own), against plain's step on
    its dynamic cache. Graph passes keep their shape and attend to every slot, as a captured pass on a GPU does
    (`graph_state.NARROWS` off, a reach as wide as the cache). A measured mask cost is measured once a batch size."""
    rows, measured, kept = [], {}, (graph_state.NARROWS, graph_state.REACH_STEP)
    graph_state.NARROWS, graph_state.REACH_STEP = False, 1 << 30
    try:
        for decoding in decodings:
            rows += _host_ops_decoding(model, tokenizer, batch_sizes, max_new_tokens, decoding, default, measured)
    finally:
        graph_state.NARROWS, graph_state.REACH_STEP = kept
    return rows


def _host_ops_decoding(
    model, tokenizer, batch_sizes, max_new_tokens: int, decoding: str, default, measured: dict
) -> list[dict]:
    """`host_ops`' rows for one decoding: on a static cache, and as the default call where asked."""
    rows = []
    caches = {"static": dict(cache_implementation="static")}
    if decoding in default:
        caches["default call"] = {}
    for cache, cache_kwargs in caches.items():
        for batch in batch_sizes:
            inputs = tokenizer(["hello world, how are you"] * batch, return_tensors="pt")
            kwargs = dict(**inputs, max_new_tokens=max_new_tokens, eos_token_id=None, **cache_kwargs)
            common = dict(batch=batch, decoding=decoding if cache == "static" else f"{decoding}, {cache}")
            rows += _host_ops_rows(model, {**kwargs, **DECODINGS[decoding]}, common, measured)
    return rows


def _host_ops_rows(model, kwargs: dict, common: dict, measured: dict) -> list[dict]:
    """`host_ops`' rows for one decoding, cache and batch: plain's step, then each mode's pass."""
    plain = _per_pass(model, functools.partial(GenerationMixin.generate, model), kwargs)
    rows = [dict(**common, method="plain generate()", **plain, ratio=1.0, kernel_ratio=1.0, steady_ratio=1.0)]
    for name, mars in MODES.items():
        call = functools.partial(model.generate, **_resolved(model, common["batch"], mars, measured))
        row = dict(**common, method=name, **_per_pass(model, call, kwargs))
        row.update(
            ratio=row["ops"] / plain["ops"],
            kernel_ratio=row["kernels"] / plain["kernels"],
            steady_ratio=row["steady"] / plain["steady"],
        )
        rows.append(row)
    return rows


def _per_pass(model, call, kwargs: dict) -> dict:
    """aten ops (`ops`; `kernels`: of them not views) per pass of `call(**kwargs)`, over the whole run, and `steady`:
    what one more pass adds, the difference between the run and one of half its new tokens over the difference of
    their passes, in which the run's set-up, the prompt's pass and the hand-over to a graph pass cancel out."""
    half = {**kwargs, "max_new_tokens": kwargs["max_new_tokens"] // 2}
    ops, kernels, passes = _ops_outside_forward(model, functools.partial(call, **kwargs))
    fewer, _, fewer_passes = _ops_outside_forward(model, functools.partial(call, **half))
    return dict(ops=ops / passes, kernels=kernels / passes, steady=(ops - fewer) / max(passes - fewer_passes, 1))


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while `inside` is 0 (the model's forward hooks raise and lower it), and of
    those the views, which launch no kernel on a GPU; and the forwards (passes)."""

    def __init__(self):
        super().__init__()
        self.outside, self.views, self.inside, self.forwards = 0, 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside == 0:
            self.outside += 1
            self.views += func.is_view
        return func(*args, **(kwargs or {}))


def _ops_outside_forward(model, call):
    """`(ops, not views, passes)`: aten ops that `call()` dispatches outside `model`'s forward (after one warm-up
    call), of them those not views, and its passes (the model's forwards)."""
    counter = _OpCounter()

    def enter(*args, **kwargs):
        counter.inside += 1
        counter.forwards += 1

    def leave(*args, **kwargs):
        counter.inside -= 1

    with torch.no_grad():
        call()
        hooks = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave)]
        try:
            with counter:
                call()
        finally:
            for hook in hooks:
                hook.remove()
    return counter.outside, counter.outside - counter.views, counter.forwards


def format_host_ops(rows: list[dict]) -> str:
    head = ["decoding", "batch", "method", "aten ops per pass", "/ plain step", "of them not views", "/ plain step"]
    head += ["one more pass", "/ plain step"]
    cells = [
        [r["decoding"], str(r["batch"]), r["method"], f"{r['ops']:.0f}", f"{r['ratio']:.2f}x"]
        + [f"{r['kernels']:.0f}", f"{r['kernel_ratio']:.2f}x", f"{r['steady']:.0f}", f"{r['steady_ratio']:.2f}x"]
        for r in rows
    ]
    return markdown_table(head, cells)


def format_pass_costs(rows: list[dict]) -> str:
    head = ["batch", "method", "ms per pass", "per pass / plain step"]
    return markdown_table(head, [[str(r["batch"]), r["method"], f"{r['ms']:.2f}", f"{r['ratio']:.2f}x"] for r in rows])
