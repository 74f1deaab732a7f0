"""MARS decoding inside `model.generate()`: several tokens per forward pass, accepted while confident.

One pass feeds the tokens committed by the previous pass plus B-1 `<|mask|>` tokens, through an ordinary causal
forward. Slot 0 is the output at the last real token (the ordinary next-token prediction); slot i >= 1 is the output
at mask i-1, which a MARS-trained model has learned to make a prediction of the token i places further on. Slot 0 is
always accepted; then slots are accepted left to right while their confidence is at least τ. With τ >= 1 no mask is
fed at all: that is exactly greedy (or sampled) autoregressive decoding, at its cost. Lossless mode (`mars_verify`)
feeds a pass's mask predictions back as drafts that the next pass verifies (`verify.py`).

`mars_decode` is one loop of named phases: `_forward` (one pass over `[pending | drafts | masks]`), `_accept`
(τ's test, or verification: which tokens each row takes), `_commit` (write them: K/V into the cache, tokens into
the text, which the stopping criteria judge; stream them), `_next_inputs` (what the next pass feeds) and `_retire`
(rows that stopped stop decoding). τ is read before every pass, so it may be a number, a callable, or a
`TauController` changed while a generation runs. A run's state is three small objects: `_Plan` (fixed before the
first pass), `_Text` (every row's text and progress; a row decodes while `active`) and `_Feed` (what the next pass
feeds).

The loop never asks which cache it has: both answer `cache.KVBook`. With `cache_implementation="static"` the K/V
live in transformers' `StaticCache` and every pass after the first has the same shape (`StaticMARSCache`), so the
compiled forward of `generate()`'s own compile path (`compile_config`) is reused from pass to pass; the tokens are
the dynamic cache's.

This file is copied into MARS checkpoints (trust_remote_code), with the sibling modules it imports.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from transformers import CompileConfig, DynamicCache, GenerationMixin, StaticCache
from transformers.cache_utils import StaticLayer
from transformers.generation import GenerationMode
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .cache import KVBook, MARSCache, StaticMARSCache, prefix_cache
from .compat import (
    CACHE_ARG,
    compiled_forward,
    eos_token_ids,
    forward_takes,
    mark_user_cache,
    model_cache,
    new_static_cache,
    pad_token,
    recurrent,
    static_cache_size,
    supports_logits_to_keep,
    user_defined_cache,
    with_cache,
)
from .costs import NEW_TOKENS, PROMPT_TOKENS, choose_dtype
from .graph import GraphShape, cut, enabled, graph_pass_for, right_align
from .schedule import MaskSchedule
from .scoring import Histories, check_stateless, choose, history_free
from .settings import CALL_KEYS, MARSSettings, TauController, mars_settings, read_tau, resolve_settings
from .stopping import Stopping
from .tree import tree_attention
from .verify import Drafts, add_lookup, propose, verify

__all__ = ["MARSGenerateOutput", "MARSGenerationMixin", "MARSStats", "TauController", "mars_decode", "mars_settings"]

# Attention implementations that take the 4D masks of lossless passes (a tree of drafts), built once per pass
_BRANCHING = ("sdpa", "eager")
# Squeeze holes out of a batched cache once they are this share of it (see `MARSCache.compact`).
_COMPACT_AT = 0.5
_COMPACT_EVERY = 8  # passes between checks (each one a device-to-host transfer)


@dataclass
class MARSStats:
    """What MARS decoding did. Every forward pass counts, the first (prefill) one included, since it yields tokens.

    Attributes:
        forward_passes: number of model forward passes.
        new_tokens: `(batch,)` tokens generated per row (what the output holds).
        passes_per_row: `(batch,)` forward passes each row took part in (a finished row leaves the batch).
        accepted_per_step: one `(batch,)` tensor per pass: tokens accepted by each row (0 once it has left), up to
            EOS and the length limit; other stopping criteria may cut a row's last ones.
        tau_per_step: the τ read before each pass.
        masks_per_step: the masks fed in each pass (the largest offer of `MaskSchedule`; 0 with τ >= 1).
    """

    forward_passes: int = 0
    new_tokens: torch.Tensor | None = None
    passes_per_row: torch.Tensor | None = None
    accepted_per_step: list[torch.Tensor] = field(default_factory=list)
    tau_per_step: list[float] = field(default_factory=list)
    masks_per_step: list[int] = field(default_factory=list)

    @property
    def tokens_per_forward(self) -> torch.Tensor:
        """`(batch,)` tokens generated per forward pass the row took part in (1.0 is plain AR decoding)."""
        return self.new_tokens.float() / self.passes_per_row.clamp(min=1).float()

    @property
    def mean_tokens_per_forward(self) -> float:
        return self.tokens_per_forward.mean().item()


@dataclass
class MARSGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus `mars_stats` (see `MARSStats`)."""

    mars_stats: MARSStats | None = None


class MARSGenerationMixin(GenerationMixin):
    """Adds MARS decoding to a causal LM's `generate()`; without `mars_tau` it is the base model's `generate()`."""

    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config=None,
        logits_processor: LogitsProcessorList | None = None,
        stopping_criteria: StoppingCriteriaList | None = None,
        *,
        mars_tau: float | Callable[[], float] | None = None,
        mars_block_size: int | None = None,
        mars_confidence: str | None = None,
        mars_verify: bool | None = None,
        mars_draft_candidates: int | list[int] | None = None,
        mars_lookup: int | None = None,
        mars_mask_cost: float | list[float] | str | None = None,
        mars_accept: str | None = None,
        mars_typical_epsilon: float | None = None,
        mars_typical_delta: float | None = None,
        streamer=None,
        **kwargs,
    ):
        r"""`GenerationMixin.generate`, plus MARS decoding when `mars_tau` is given (or set in the generation config).

        Args (each read from the keyword, then the `generation_config` passed, then `model.generation_config`; in
        lossless mode a config's `mars_lossless` preset comes first: docs/decoding.md, "Settings"):
            mars_tau (`float` or callable): confidence threshold in [0, 1]; 1 is exactly autoregressive decoding. A
                callable (e.g. `TauController`) is read before every pass. Unset everywhere: the base `generate()`.
            mars_block_size (`int`): B, at most B tokens per pass. Default: the B the model was trained with.
            mars_confidence (`str`): "probability" (default), "entropy" or "margin" (`scoring.confidence`).
            mars_verify (`bool`): lossless mode. The masks' guesses become drafts, kept only where they equal the
                model's own prediction (greedy) or by speculative sampling, so the output is `generate()`'s for any
                τ (exactly in float32; in bfloat16 near-ties can flip: docs/decoding.md). τ only sets how many
                drafts are proposed. With `mars_lossless="auto"` the tree is the one this machine's pass costs
                favour, or none (`costs.py`).
            mars_draft_candidates (`int`/list): lossless, greedy: first-draft candidates, or per depth (default 1).
            mars_lookup (`int`): lossless, greedy: a branch of up to this many drafts by prompt lookup (default 0).
            mars_mask_cost (`float`, list or "auto"): what masks add to a pass, as a share of a one-token pass (per
                count; "auto": measured here). 0 (default): B-1 masks every pass; else only those worth their time.
            mars_accept (`str`): lossless mode's rule for keeping drafts: "exact" (default: the output is the model's
                own) or "typical", Medusa's typical acceptance, which also keeps a draft the verifying distribution
                gives at least min(ε, δ·exp(-entropy)): more tokens per pass, but other answers (not lossless).
            mars_typical_epsilon, mars_typical_delta (`float`): typical acceptance's ε (default 0.09) and δ (0.3).

        Works with sampling, logits processors, EOS ids, `stop_strings`, stopping criteria (called as `generate()`
        calls them), static caches and streamers (a pass's tokens as one chunk). `return_dict_in_generate=True`
        gives a `MARSGenerateOutput` with `mars_stats`. `model.mars_settings(...)` shows what a call runs with.
        """
        base = generation_config if generation_config is not None else self.generation_config
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        batch_size = ids.shape[0] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else 1
        mars_kwargs = dict(mars_tau=mars_tau, mars_block_size=mars_block_size, mars_confidence=mars_confidence)
        mars_kwargs.update(mars_verify=mars_verify, mars_draft_candidates=mars_draft_candidates)
        mars_kwargs.update(mars_lookup=mars_lookup, mars_mask_cost=mars_mask_cost, mars_accept=mars_accept)
        mars_kwargs.update(mars_typical_epsilon=mars_typical_epsilon, mars_typical_delta=mars_typical_delta)
        call = {name: kwargs[name] for name in CALL_KEYS if name in kwargs}
        settings = resolve_settings(self, generation_config, batch_size, call, **mars_kwargs)
        if settings is not None:
            _refuse_unsupported(base, kwargs, "mars_verify" if settings.verify else "mars_tau")
        if settings is None or settings.plain:  # plain decoding: the base model's generate(), with stats if MARS
            extra = {"streamer": streamer} if streamer is not None else {}
            out = super().generate(inputs, generation_config, logits_processor, stopping_criteria, **extra, **kwargs)
            return out if settings is None else _with_plain_stats(out, ids.shape[-1] if ids is not None else 0, base)
        stopping_criteria, generation_config = _stop_strings_as_criterion(
            base, generation_config, stopping_criteria, kwargs
        )
        mark_user_cache(kwargs)
        decode = functools.partial(mars_decode, settings=settings, streamer=streamer)
        return super().generate(
            inputs, generation_config, logits_processor, stopping_criteria, custom_generate=decode, **kwargs
        )

    def mars_settings(self, generation_config=None, batch_size: int = 1, **mars_kwargs) -> dict | None:
        """What `generate(**mars_kwargs)` runs with at this batch size, defaults resolved (see `mars_settings`)."""
        return mars_settings(self, generation_config, batch_size, **mars_kwargs)

    def mars_dtype(self, batch_size: int = 1, prompt_tokens: int = PROMPT_TOKENS, new_tokens: int = NEW_TOKENS):
        """The dtype in which lossless decoding of such calls is expected fastest on this machine, and why: a
        `costs.DtypeChoice` (`.dtype`, `.reason()`), from pass costs measured here (float32 and bfloat16 where the
        device runs it), the prompt's forward included."""
        return choose_dtype(self, batch_size, prompt_tokens, new_tokens)

    def mars_cache_length(self, prompt_length: int, max_new_tokens: int, batch_size: int = 1, **mars_kwargs) -> int:
        """The static cache slots `generate(cache_implementation="static", **mars_kwargs)` needs for this prompt length
        and budget. Set `generation_config.max_cache_len` to the largest a server will meet, and compiled passes are
        never recompiled for a larger cache (as for plain `generate()`)."""
        call = {name: mars_kwargs.pop(name) for name in CALL_KEYS if name in mars_kwargs}
        settings = resolve_settings(self, None, batch_size, call, **mars_kwargs)
        if settings is None:
            return prompt_length + max_new_tokens
        return static_cache_length(settings, prompt_length, max_new_tokens)


def static_cache_length(settings: MARSSettings, prompt_length: int, max_new_tokens: int, candidates=None, lookup=None):
    """Static cache slots a MARS generation may need. A pass advances `1 + drafts_per_pass` slots whatever it accepts:
    B pending slots in τ-mode, the root and the full draft tree in lossless mode; the last pass also writes its masks.
    `candidates`, `lookup`: what lossless mode's tree really has (they may be fewer than asked, see `_prepare`)."""
    if candidates is not None or lookup is not None:
        candidates = settings.draft_candidates if candidates is None else candidates
        settings = replace(settings, draft_candidates=candidates, lookup=settings.lookup if lookup is None else lookup)
    per_pass = 1 + settings.drafts_per_pass
    groups = per_pass if settings.verify else 1  # groups of masks: after the root and after each draft
    return prompt_length + max_new_tokens * per_pass + per_pass + groups * (settings.block_size - 1)


def _with_plain_stats(out, prompt_length: int, generation_config):
    """Lossless mode that ran as plain decoding (no tree pays on this machine) reports one token per pass."""
    if not isinstance(out, GenerateDecoderOnlyOutput):
        return out
    generated = out.sequences[:, prompt_length:]
    eos = eos_token_ids(generation_config, generated.device)
    ended = torch.isin(generated, eos) if eos.numel() else torch.zeros_like(generated, dtype=torch.bool)
    width = generated.shape[1]
    new_tokens = torch.where(ended.any(dim=1), ended.float().argmax(dim=1) + 1, width)
    stats = MARSStats(width, new_tokens, passes_per_row=new_tokens.clone(), masks_per_step=[0] * width)
    return MARSGenerateOutput(**{**out, "mars_stats": stats})


def _refuse_unsupported(base, kwargs, mode: str) -> None:
    """`mode`: the MARS argument that turned MARS decoding on, named in the errors."""
    for name in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit"):
        if kwargs.get(name) is not None or getattr(base, name, None) is not None:
            hint = " (lossless mode has its own: `mars_lookup`)" if name == "prompt_lookup_num_tokens" else ""
            raise ValueError(f"`{mode}` cannot be combined with assisted decoding (`{name}`){hint}.")
    if "inputs_embeds" in kwargs:
        raise ValueError("MARS decoding needs `input_ids`, not `inputs_embeds`.")


def _stop_strings_as_criterion(base, generation_config, stopping_criteria, kwargs):
    """`generate` hands a callable decoder no tokenizer, so stop strings become a criterion here."""
    stop_strings = kwargs.pop("stop_strings", None) or getattr(base, "stop_strings", None)
    tokenizer = kwargs.pop("tokenizer", None)
    if not stop_strings:
        return stopping_criteria, generation_config
    if tokenizer is None:
        raise ValueError("Stop strings need the model's tokenizer: pass `tokenizer=` to `generate`.")
    stopping_criteria = StoppingCriteriaList(stopping_criteria or [])
    stopping_criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    if getattr(base, "stop_strings", None):
        generation_config = copy.deepcopy(base)
        generation_config.stop_strings = None
    return stopping_criteria, generation_config


@dataclass(frozen=True)
class SlidingWindow:
    """The sliding window of a model's sliding-window layers: `size` positions; `everywhere`: every layer slides (one
    mask for all), else the forward takes masks by layer type."""

    size: int
    everywhere: bool


@dataclass(frozen=True)
class _Plan:
    """What one generation runs with, fixed before its first pass."""

    settings: MARSSettings
    processors: LogitsProcessorList
    do_sample: bool
    typical: tuple[float, float] | None  # lossless mode: `(ε, δ)` of typical acceptance, or None (exact)
    candidates: int | tuple[int, ...]  # lossless mode: `mars_draft_candidates` (1 where drafts stay a chain)
    lookup: int  # lossless mode: tokens of prompt lookup's branch (0 where drafts stay a chain)
    prompt_length: int
    budget: int  # new tokens allowed (what MaxLengthCriteria allows)
    pad_token_id: int
    eos: torch.Tensor
    logits_to_keep: bool
    window: SlidingWindow | None  # the model's sliding window, whose masks MARS builds (None: no sliding layers)
    compiled: Callable | None  # the compiled forward of passes after the first (a static cache), else None
    streamer: object = None


@dataclass
class _Text:
    """Every row of the batch: its text and how far it got. A row decodes while it is `active`; it stops being active
    once its text has `ended` (EOS or the length limit) or the stopping criteria have settled it."""

    sequences: torch.Tensor  # (batch, prompt + budget + room): the prompt, then each row's decoded tokens, then pad
    prompt_real: torch.Tensor  # (batch, prompt_length): which prompt positions hold tokens (not padding)
    decoded: torch.Tensor  # (batch,) new tokens decoded
    passes: torch.Tensor  # (batch,) passes each row took part in
    ended: torch.Tensor  # (batch,) rows whose text reached EOS or the length limit
    active: torch.Tensor  # (batch,) rows still decoding


@dataclass
class _Feed:
    """What the next pass feeds, for the rows the cache holds (`rows`: their indices in the batch, in its order)."""

    rows: torch.Tensor
    pending: torch.Tensor  # committed tokens not in the cache yet, right-aligned
    pending_real: torch.Tensor
    drafts: Drafts
    dense: bool | None = None  # whether the pending tokens fill their slots (no holes); None: not known


@dataclass
class _Run:
    """What one MARS generation carries from pass to pass."""

    plan: _Plan
    text: _Text
    feed: _Feed
    cache: KVBook
    schedule: MaskSchedule
    stopping: Stopping
    stats: MARSStats = field(default_factory=MARSStats)
    live: bool = True  # any row still decoding


@dataclass
class _Pass:
    """One forward pass: what it fed and what came out."""

    tau: float
    offered: torch.Tensor  # (rows,) masks each row may use
    masks: int  # masks per group (the largest offer, or more where that is cheaper)
    logits: torch.Tensor  # (rows, outputs, vocab): at the root, at each draft, then each group of masks
    histories: Histories | None
    end: torch.Tensor | None = None  # lossless mode: where each row's kept drafts end (0: the root)
    kept_drafts: torch.Tensor | None = None  # lossless mode: (rows, drafts) the drafts verified and kept

    @property
    def within(self) -> torch.Tensor:
        """`(rows, masks)`: which masks each row may use."""
        return torch.arange(self.masks, device=self.offered.device) < self.offered[:, None]


def mars_decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    synced_gpus: bool = False,
    *,
    settings: MARSSettings,
    streamer=None,
    **model_kwargs,
):
    """The MARS decoding loop; `generate()` calls it with prepared inputs, processors and criteria."""
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError("Streamers take one sequence: batch size must be 1 with `streamer`.")
    criteria = stopping_criteria
    run = _prepare(model, input_ids, logits_processor, criteria, generation_config, settings, streamer, model_kwargs)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    while run.live:
        shape = _graph_shape(model, run) if run.stats.forward_passes else None
        if shape is not None:  # the rest of the generation as one graph per pass (`graph.py`)
            _decode_in_graph(model, run, shape, _compile_config(generation_config) if run.plan.compiled else None)
            break
        step = _forward(model, run, read_tau(settings.tau))
        tokens, accepted = _accept(run, step)
        _commit(run, step, tokens, accepted)
        _next_inputs(run, step, tokens, accepted)
        _retire(run)
    return _finish(run, generation_config)


def _graph_shape(model, run: _Run) -> GraphShape | None:
    """The `GraphShape` that continues this run as one graph per pass, or None where the loop here must run: it needs
    a static cache that counts its writes, greedy decoding with no logits processors, EOS and the length limit as the
    only stopping criteria, no streamer, masks in every pass (no mask cost), and, in lossless mode, exact verification
    of a full draft tree (the first pass proposed one)."""
    plan, cache, feed, settings = run.plan, run.cache, run.feed, run.plan.settings
    if not (enabled() and isinstance(cache, StaticMARSCache) and cache.counts_writes and plan.logits_to_keep):
        return None
    if plan.do_sample or plan.processors or plan.typical or plan.window or plan.streamer is not None:
        return None
    if not (run.stopping.per_row and run.schedule.constant):
        return None
    if model.config._attn_implementation not in _BRANCHING:
        return None
    if settings.verify and len(feed.drafts.tree) != settings.drafts_per_pass:
        return None
    verify = settings.verify
    masks = 0 if not verify and not callable(settings.tau) and settings.tau >= 1.0 else settings.block_size - 1
    return GraphShape(
        batch=run.text.sequences.shape[0],
        slots=cache.size,
        verify=verify,
        pending=1 if verify or not masks else settings.block_size,
        tree=feed.drafts.tree,
        masks=masks,
        confidence=settings.confidence,
        candidates=plan.candidates,
        lookup=plan.lookup,
        mask_token_id=settings.mask_token_id,
        pad_token_id=plan.pad_token_id,
        eos=plan.eos.numel(),
    )


def _compile_config(generation_config) -> CompileConfig:
    """The `CompileConfig` `generate()` compiles with (its default where the config has none)."""
    return generation_config.compile_config or CompileConfig()


def _decode_in_graph(model, run: _Run, shape: GraphShape, compile_config) -> None:
    """Decode until every row is done with `graph.py`'s pass: the run's state goes into the graph pass's buffers,
    then one pass (one graph replay under `generate()`'s compile path on CUDA) and one read of `finished` per pass,
    then the state comes back. One generation at a time uses a model's graph pass of a shape."""
    g = graph_pass_for(model, run.cache.kv, shape, compile_config)
    _load_graph(g, run)
    passes, last_tau = 0, None
    while True:
        tau = read_tau(run.plan.settings.tau)
        if tau != last_tau:  # τ >= 1 accepts (or proposes) nothing beyond slot 0, even a probability rounded to 1
            g.state.tau.fill_(tau if tau < 1.0 else float("inf"))
            last_tau = tau
        g.run()
        passes += 1
        run.stats.tau_per_step.append(tau)
        run.stats.masks_per_step.append(shape.masks)
        if g.state.finished.item():
            break
    _unload_graph(g, run, passes)


def _load_graph(g, run: _Run) -> None:
    """The run's state, as its first pass left it, into the graph pass's buffers."""
    plan, text, cache, feed, state = run.plan, run.text, run.cache, run.feed, g.state
    width = text.sequences.shape[1]
    state.sequences[:, :width].copy_(text.sequences)
    state.sequences[:, width:].fill_(plan.pad_token_id)
    for name, value in (("prompt_length", plan.prompt_length), ("budget", plan.budget), ("slot", cache.length)):
        getattr(state, name).fill_(value)
    for name, value in (("decoded", text.decoded), ("passes", text.passes), ("done", ~text.active)):
        getattr(state, name).copy_(value)
    state.real.copy_(cache.real)
    state.next_position.copy_(cache.next_position)
    pad = g.shape.pending - feed.pending.shape[1]  # τ-mode after a first pass without masks: holes on the left
    state.pending.copy_(torch.nn.functional.pad(feed.pending, (pad, 0), value=plan.pad_token_id))
    state.pending_real.copy_(torch.nn.functional.pad(feed.pending_real, (pad, 0), value=False))
    state.drafts.copy_(feed.drafts.tokens)
    state.drafts_real.copy_(feed.drafts.real)
    state.step.zero_()
    g.eos.copy_(plan.eos)


def _unload_graph(g, run: _Run, passes: int) -> None:
    """What `passes` graph passes decided, back into the run, for `_finish`."""
    text, cache, stats, state = run.text, run.cache, run.stats, g.state
    text.sequences.copy_(state.sequences[:, : text.sequences.shape[1]])
    text.decoded.copy_(state.decoded)
    text.passes.copy_(state.passes)
    cache.kv = g.kv  # where this run's K/V now are (the output's cache is copied from them)
    cache.real.copy_(state.real)
    cache.next_position = state.next_position.clone()
    cache.length += passes * g.shape.kept
    run.stopping.new_tokens = state.decoded.clone()  # EOS and the length limit alone: each row's own count
    stats.forward_passes += passes
    stats.accepted_per_step.extend(state.accepted_log[:passes].clone().unbind(0))


def _prepare(model, input_ids, processors, criteria, generation_config, settings, streamer, model_kwargs) -> _Run:
    """Check what MARS can do exactly, then set up the cache, the mask schedule and the stopping criteria."""
    batch, prompt_length = input_ids.shape
    device = input_ids.device
    window = _check_decodable(model, generation_config, settings, prompt_length, processors)
    eos = eos_token_ids(generation_config, device)
    pad_token_id = pad_token(generation_config, eos)
    budget = generation_config.max_length - prompt_length
    room = 1 + settings.drafts_per_pass  # a pass writes this many slots past a row's tokens (pad past those taken)
    sequences = torch.full((batch, prompt_length + budget + room), pad_token_id, dtype=torch.long, device=device)
    sequences[:, :prompt_length] = input_ids
    attention_mask = model_kwargs.get("attention_mask")
    prompt_real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    # Sibling drafts (candidates, a lookup branch) need greedy verification or typical acceptance, whose processors
    # (if any) read no history: with speculative sampling, or a history-reading processor, drafts stay a chain
    do_sample, typical = generation_config.do_sample, settings.typical
    branching = (not do_sample or typical is not None) and (not processors or history_free(processors))
    candidates = settings.draft_candidates if branching else 1
    lookup = settings.lookup if settings.verify and branching else 0
    cache, compiled = _cache(model, generation_config, settings, model_kwargs, prompt_real, candidates, lookup, window)
    cached = cache.length  # a cache passed in holds the first tokens of every row already
    plan = _Plan(
        settings=settings,
        processors=processors,
        do_sample=do_sample,
        typical=typical,
        candidates=candidates,
        lookup=lookup,
        prompt_length=prompt_length,
        budget=budget,
        pad_token_id=pad_token_id,
        eos=eos,
        logits_to_keep=supports_logits_to_keep(model),
        window=window,
        compiled=compiled,
        streamer=streamer,
    )
    zeros = torch.zeros(batch, dtype=torch.long, device=device)
    everyone = torch.ones(batch, dtype=torch.bool, device=device)
    text = _Text(sequences, prompt_real, decoded=zeros, passes=zeros.clone(), ended=~everyone, active=everyone)
    rows = torch.arange(batch, device=device)
    feed = _Feed(rows, input_ids[:, cached:], prompt_real[:, cached:], Drafts.none(batch, device))
    schedule = MaskSchedule(settings.mask_cost, batch, settings.block_size - 1, device)
    return _Run(plan, text, feed, cache, schedule, Stopping(criteria, sequences, prompt_length, pad_token_id))


def _cache(model, generation_config, settings, model_kwargs, prompt_real, candidates, lookup, window):
    """`(cache, compiled forward or None)`. A `StaticCache` that `generate()` made (`cache_implementation="static"`)
    or was given is sized for MARS, whose passes write more slots than they keep, with `generate()`'s own helper (it
    remembers the size, so later calls reuse it and nothing recompiles); `generate()`'s rule decides on compiling.
    A dynamic cache that holds the first tokens of every row (one a `generate()` call returned) is continued."""
    (batch, prompt_length), device = prompt_real.shape, prompt_real.device
    cache = model_cache(model_kwargs)
    keep_retired = bool(generation_config.return_dict_in_generate)  # the output returns every row's cache
    filled = cache is not None and bool(cache.get_seq_length() > 0)
    if not isinstance(cache, StaticCache):
        if not filled:
            return MARSCache(batch, device, keep_retired), None
        return _continued(cache, prompt_real, keep_retired), None
    if filled:
        raise ValueError("MARS decoding starts from an empty static cache (a filled dynamic one it continues).")
    full = all(type(layer) is StaticLayer for layer in cache.layers)
    if not full and user_defined_cache(cache):
        raise ValueError("MARS decoding takes a static cache of full-attention layers only (it builds the windows).")
    budget = generation_config.max_length - prompt_length
    size = static_cache_length(settings, prompt_length, budget, candidates, lookup)
    if static_cache_size(cache) < size or not full:  # sliding layers keep a window of slots: MARS needs them all
        if user_defined_cache(cache):
            raise ValueError(f"MARS decoding needs a StaticCache of at least {size} slots here (max_cache_len).")
        cache = new_static_cache(model, generation_config, batch, size, model_kwargs, full_layers=not full)
    compiled = compiled_forward(model, generation_config, model_kwargs)
    return StaticMARSCache(cache, batch, device), compiled


def _continued(cache, prompt_real, keep_retired: bool) -> MARSCache:
    """A MARS cache that continues `cache`, which holds K/V of the first tokens of every row of the prompt."""
    length = cache.get_seq_length()
    if length >= prompt_real.shape[1]:
        raise ValueError(
            f"The cache passed holds {length} tokens, the input {prompt_real.shape[1]}: pass at least one new token."
        )
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        raise ValueError("MARS decoding continues a cache of full-attention layers only (no sliding windows).")
    return MARSCache.from_prefix(cache, prompt_real, keep_retired)


def _forward(model, run: _Run, tau: float) -> _Pass:
    """One forward pass over `[pending | drafts | masks]`: one group of masks after the root (τ-mode: the only one)
    and, in lossless mode, one after each draft, each continuing the text it follows (see `DraftTree`). How many
    masks a group has is the cache's call (a static cache feeds all B-1, whatever a row is offered, so that its shape
    stays)."""
    plan, feed, cache = run.plan, run.feed, run.cache
    offered = run.schedule.offer(feed.rows) if tau < 1.0 else torch.zeros_like(feed.rows)
    masks = cache.masks_per_group(run.schedule, offered, tau)
    tree = feed.drafts.tree
    groups = len(tree) + 1
    new_real = torch.cat([feed.pending_real, feed.drafts.real], dim=1)
    mask_2d, position_ids = cache.step_inputs(new_real, masks, tree, feed.dense if not len(tree) else None)
    attention_mask = _attention_mask(model, run, tree, mask_2d, masks, position_ids)
    mask_ids = feed.pending.new_full((feed.rows.numel(), groups * masks), plan.settings.mask_token_id)
    needed = len(tree) + 1 + groups * masks
    forward = plan.compiled if plan.compiled is not None and run.stats.forward_passes else model  # prefill: eager
    input_ids = torch.cat([feed.pending, feed.drafts.tokens, mask_ids], dim=1)
    outputs = forward(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        **cache.forward_kwargs(input_ids.shape[1]),
        return_dict=True,
        **({"logits_to_keep": needed} if plan.logits_to_keep else {}),
    )
    logits = outputs.logits[:, -needed:].float()
    lengths = plan.prompt_length + run.text.decoded[feed.rows]
    histories = Histories(plan.processors, run.text.sequences, feed.rows, lengths) if plan.processors else None
    return _Pass(tau, offered, masks, logits, histories)


def _attention_mask(model, run: _Run, tree, mask_2d, masks: int, position_ids):
    """What the forward takes as its attention mask. The 2D slot map (or None: no holes) where the model's own causal
    mask is exact; else 4D masks built here, once per pass: for a draft tree, for a wide pass where the cache leaves
    it to MARS (rather than to every layer), and, with sliding-window layers, wherever slots are not positions
    (holes, padding, a static cache), since the model would count its window in slots."""
    window = run.plan.window
    windowed = window is not None and mask_2d is not None
    wide = run.cache.wide_mask(position_ids.shape[1]) and model.config._attn_implementation in _BRANCHING
    if not (len(tree) or windowed or wide):
        return mask_2d
    build = functools.partial(tree_attention, model, run.cache, tree, mask_2d, run.feed.pending.shape[1], masks)
    if window is None:
        return build()
    sliding = build(window=window.size, positions=position_ids)
    return sliding if window.everywhere else {"full_attention": build(), "sliding_attention": sliding}


def _accept(run: _Run, step: _Pass) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens each row takes from this pass: `(tokens, accepted)`, cut at EOS and the length limit (a row no
    longer active takes none). Tells the mask schedule what its masks were worth."""
    plan, text, feed, schedule = run.plan, run.text, run.feed, run.schedule
    rows, tree = feed.rows, feed.drafts.tree
    if plan.settings.verify:
        tokens, accepted, step.kept_drafts, step.end = verify(
            step.logits[:, : len(tree) + 1], feed.drafts, step.histories, plan.do_sample, plan.typical
        )
        # The drafts the last pass's masks proposed paid for what of them was kept
        paid = step.kept_drafts[:, : tree.from_masks].sum(dim=1)
        schedule.update(rows, schedule.last[rows], paid, text.passes[rows])
        schedule.last[rows] = step.offered
    else:
        tokens, confs = choose(step.logits, step.histories, plan.do_sample, plan.settings.confidence)
        accepted = torch.ones_like(tokens[:, 0])  # slot 0 always; then left to right while confident
        if step.masks:
            accepted += ((confs[:, 1:] >= step.tau) & step.within).long().cumprod(dim=1).sum(dim=1)
        schedule.update(rows, step.offered, accepted - 1, text.passes[rows])
    accepted, ended = cut(tokens, accepted, plan.budget - text.decoded[rows], ~text.active[rows], plan.eos)
    text.ended[rows] |= ended
    return tokens, accepted


def _commit(run: _Run, step: _Pass, tokens: torch.Tensor, accepted: torch.Tensor) -> None:
    """Write what the pass decided: the real tokens' K/V into the cache (the masks' and rejected drafts' are dropped,
    or left as holes), the accepted tokens into the text, which the stopping criteria then judge as `generate()`
    would; stream them."""
    plan, text, feed = run.plan, run.text, run.feed
    rows, width = feed.rows, tokens.shape[1]
    if plan.settings.verify:  # the root and the kept drafts are cached; rejected drafts leave holes
        fed = torch.cat([feed.pending_real, step.kept_drafts], dim=1)
        run.cache.commit(fed, (len(feed.drafts.tree) + 1) * step.masks)
    else:
        run.cache.commit(feed.pending_real, step.masks, feed.dense)
    slots = torch.arange(width, device=tokens.device)
    positions = (plan.prompt_length + text.decoded[rows])[:, None] + slots  # `sequences` has room past the budget
    taken = tokens.masked_fill(slots >= accepted[:, None], plan.pad_token_id)  # pad where nothing was written yet
    text.sequences.index_put_((rows[:, None], positions), taken)
    text.decoded[rows] += accepted
    text.passes[rows] += text.active[rows].long()  # idle rows take no pass
    streamed = run.stopping.new_tokens[0].item() if plan.streamer is not None else 0
    run.stopping.judge(text.decoded, text.ended)
    stats = run.stats
    stats.forward_passes += 1
    stats.tau_per_step.append(step.tau)
    stats.masks_per_step.append(step.masks)
    whole = rows.numel() == text.decoded.numel()  # rows are the whole batch, in order
    stats.accepted_per_step.append(accepted if whole else torch.zeros_like(text.decoded).index_put((rows,), accepted))
    if plan.streamer is not None:  # batch 1: the row is judged as soon as it decodes
        start = plan.prompt_length + streamed
        plan.streamer.put(text.sequences[0, start : plan.prompt_length + run.stopping.new_tokens[0]].cpu())


def _next_inputs(run: _Run, step: _Pass, tokens: torch.Tensor, accepted: torch.Tensor) -> None:
    """What the next pass feeds. τ-mode: this pass's accepted tokens, right-aligned (shorter rows leave holes in the
    cache). Lossless mode: the last token (kept drafts are cached already) and the next drafts, proposed by the group
    of masks that followed the last kept draft, which saw the text as it now stands."""
    plan, feed = run.plan, run.feed
    if not plan.settings.verify:
        if tokens.shape[1] == 1:  # no masks were fed: one token each
            feed.pending, feed.pending_real, feed.dense = tokens, torch.ones_like(tokens, dtype=torch.bool), True
            return
        width, feed.dense = run.cache.pending_width(tokens.shape[1], accepted)
        feed.pending, feed.pending_real = right_align(tokens, accepted, width, plan.pad_token_id)
        return
    feed.dense = None  # unknown: drafts may leave slots empty
    rows = feed.rows
    feed.pending = tokens.gather(1, (accepted - 1).clamp(min=0)[:, None])
    feed.pending_real = torch.ones_like(feed.pending, dtype=torch.bool)
    full = run.cache.fixed_shapes  # the tree keeps its whole shape, filled or not
    drafts = Drafts.none(rows.numel(), rows.device)
    lengths = plan.prompt_length + run.text.decoded[rows]
    if step.masks:
        if step.histories is not None:
            step.histories.lengths = lengths  # now including this pass's tokens
        groups = len(feed.drafts.tree) + 1
        followed = step.logits[:, groups:].unflatten(1, (groups, step.masks))
        followed = followed[torch.arange(rows.numel(), device=rows.device), step.end]
        sampled = plan.do_sample and plan.typical is None  # typical acceptance verifies the greedy tree's drafts
        proposal = (step.histories, step.tau, step.within, plan.settings, sampled, plan.candidates)
        drafts = propose(followed, *proposal, plan.pad_token_id, full)
    if plan.lookup:
        drafts = add_lookup(drafts, run.text.sequences[rows], lengths, plan.lookup, plan.pad_token_id, full)
    feed.drafts = drafts


def _retire(run: _Run) -> None:
    """Rows that stopped, or reached EOS or the length limit, stop decoding. The cache decides whether they leave its
    batch (a dynamic one drops them, so they stop costing compute) or stay, idle (a static one, so that shapes stay,
    as `generate()` keeps finished rows)."""
    text, feed = run.text, run.feed
    stopped = text.ended[feed.rows] | run.stopping.settled[feed.rows]
    text.active[feed.rows] = ~stopped
    alive, run.live = run.cache.retire(stopped)
    if alive is not None:
        feed.rows, feed.pending, feed.pending_real = feed.rows[alive], feed.pending[alive], feed.pending_real[alive]
        feed.drafts = feed.drafts.select(alive)
    run.cache.tidy(run.stats.forward_passes, _COMPACT_EVERY, _COMPACT_AT)


def _finish(run: _Run, generation_config):
    plan, text = run.plan, run.text
    if plan.streamer is not None:
        plan.streamer.end()
    new_tokens = run.stopping.new_tokens
    run.stats.new_tokens, run.stats.passes_per_row = new_tokens, text.passes
    sequences = text.sequences[:, : plan.prompt_length + int(new_tokens.max())]
    if not generation_config.return_dict_in_generate:
        return sequences
    cache = None
    if generation_config.use_cache is not False:  # as `generate()`: K/V of every position but the last
        limits = (plan.prompt_length + new_tokens).clamp(max=sequences.shape[1] - 1)
        tokens_at = torch.cat([text.prompt_real, text.prompt_real.new_ones(sequences.shape)], dim=1)
        cache = prefix_cache(run.cache, tokens_at[:, : sequences.shape[1]], limits)
    return with_cache(MARSGenerateOutput, cache, sequences=sequences, mars_stats=run.stats)


def _check_decodable(model, generation_config, settings: MARSSettings, prompt_length: int, processors):
    """Refuse, with a reason, what MARS decoding cannot do exactly; return the model's `SlidingWindow` (or None)."""
    if settings.verify:
        check_stateless(processors, "lossless mode (mars_verify=True)")
    elif callable(settings.tau) or settings.tau < 1.0:
        check_stateless(
            processors, f"mars_tau={settings.tau!r}" if not callable(settings.tau) else "a callable mars_tau"
        )
    mode = generation_config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(f"`mars_tau` works with greedy decoding and sampling, not {mode.value} (e.g. num_beams > 1).")
    for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if getattr(generation_config, name, False):
            raise ValueError(f"`{name}` is not supported with `mars_tau`.")
    if generation_config.cache_implementation not in (None, "dynamic", "static"):
        raise ValueError(
            "MARS decoding runs on a dynamic cache or a static one (`cache_implementation='static'`), "
            f"not {generation_config.cache_implementation!r}."
        )
    if model.config.is_encoder_decoder:
        raise ValueError("MARS decoding needs a decoder-only causal LM.")
    if not forward_takes(model, "position_ids", "attention_mask", CACHE_ARG):
        raise ValueError(f"{type(model).__name__}.forward must take position_ids, attention_mask and {CACHE_ARG}.")
    if settings.verify and getattr(model.config, "_attn_implementation", None) not in _BRANCHING:
        raise ValueError(
            "Lossless mode (`mars_verify`) feeds drafts as a tree, which needs an attention implementation that takes "
            f"a 4D mask: one of {_BRANCHING}, not {model.config._attn_implementation!r}."
        )
    return _check_cache_layers(model, generation_config, prompt_length, 1 + settings.drafts_per_pass)


def _check_cache_layers(model, generation_config, prompt_length: int, slots_per_token: int) -> SlidingWindow | None:
    """Recurrent layers cannot drop masks. Sliding-window layers are exact where MARS builds their 4D masks (sdpa,
    eager: windows counted in positions); elsewhere only while the generation fits in the window, since holes push
    slots apart. `slots_per_token`: the most cache slots a pass may fill per token it yields (holes included)."""
    if recurrent(model):
        raise ValueError(
            f"{type(model).__name__} has recurrent/linear-attention layers, whose state cannot drop masks."
        )
    probe = DynamicCache(config=model.config)
    sliding = [getattr(layer, "is_sliding", False) for layer in probe.layers]
    windows = {layer.sliding_window for layer, slides in zip(probe.layers, sliding) if slides}
    if not windows:
        return None
    if len(windows) == 1 and model.config._attn_implementation in _BRANCHING:
        return SlidingWindow(windows.pop(), everywhere=all(sliding))
    longest = prompt_length + (generation_config.max_length - prompt_length) * slots_per_token
    if min(windows) < longest:
        raise ValueError(
            f"Sliding-window attention ({min(windows)} tokens) is only exact with MARS while the whole generation "
            f"fits in the window, unless the attention implementation takes a 4D mask ({_BRANCHING}); this one may "
            f"reach {longest} cache slots. Lower max_new_tokens, or load the model with attn_implementation='sdpa'."
        )
    return None
