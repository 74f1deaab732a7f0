"""MARS decoding inside `model.generate()`: several tokens per forward pass, accepted while confident.

`MARSGenerationMixin.generate` resolves the call's MARS settings (`settings.py`) and refuses what MARS cannot do
exactly; plain settings run the base model's `generate()`. Otherwise `generate()`'s own preparation (config,
processors, stopping criteria, cache) hands its inputs to `mars_decode`, which prepares a `Session` over the batch
(`session.py`: the rows, their text, the next pass's inputs) and decodes it in a `Runner` (`runner.py`: the prompt's
pass into the runner's rows, then `graph.py`'s graph pass until every row has stopped) on a static cache: the one
`cache_implementation="static"` makes, or, for the default call (no cache asked for, or a dynamic one, whose K/V it
takes), one of its own. Either way its pass compiles by `generate()`'s rule for a static cache (on a GPU, captured),
but for processors only transformers applies. A model whose attention takes no 4D masks, or that spans several
devices, is refused by name (`_check_one_runner`).
`model.mars_session` decodes rows prepared the same way (`model.mars_rows`) in a runner of their own, for a caller
that steps it itself (a server, the Space: rows join and leave between passes).

This file is copied into MARS checkpoints (trust_remote_code), with the sibling modules it imports.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from transformers import CompileConfig, DynamicCache, GenerationMixin, StaticCache
from transformers.cache_utils import StaticLayer
from transformers.generation import GenerationMode
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .cache import StaticMARSCache, allocate_layers, prefix_cache
from .compat import (
    CACHE_ARG,
    compiles,
    eos_token_ids,
    forward_takes,
    full_attention_config,
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
from .graph_state import GraphShape, captured, graph_pass_for, keep_cache, lend_cache, processor_fields
from .runner import Runner, graph_shape, runner_tree, serving_runner
from .schedule import MaskSchedule
from .scoring import check_stateless, without_implied_minimum
from .session import BRANCHING, Feed, MARSStats, Plan, Session, SlidingWindow, Text, draft_shape
from .settings import CALL_KEYS, CONFIG_KEYS, MARSSettings, TauController, mars_settings, resolve_settings
from .stopping import Stopping, stream
from .verify import Drafts

# Passes' width of slots a static cache keeps past the text: it compacts at most once in that many passes
SPARE_PASSES = 4
# The default call's own static cache is a multiple of this many slots, so that calls of nearby lengths decode with one
# kept graph pass (`graph_pass_for`, per shape); its eager passes attend to the slots in use alone
DEFAULT_SLOTS_STEP = 256

__all__ = ["MARSGenerateOutput", "MARSGenerationMixin", "MARSStats", "TauController", "mars_decode", "mars_settings"]


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
            mars_lossless, mars_acceptance: generation config keys (lossless mode's presets, `"auto"`'s table);
                passed here, they are this call's config's (`mars_lossless="2x3+4"`: that tree).

        Works with sampling, logits processors, EOS ids, `stop_strings`, stopping criteria (called as `generate()`
        calls them), static caches and streamers (a pass's tokens as one chunk). `return_dict_in_generate=True`
        gives a `MARSGenerateOutput` with `mars_stats`. `model.mars_settings(...)` shows what a call runs with.
        """
        mars_kwargs = {name: value for name, value in locals().items() if name.startswith("mars_")}
        mars_kwargs |= {name: kwargs.pop(name) for name in CONFIG_KEYS if name in kwargs}  # the call's config's
        base = generation_config if generation_config is not None else self.generation_config
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        call = {name: kwargs[name] for name in CALL_KEYS if name in kwargs}
        settings = resolve_settings(self, generation_config, _rows(ids), call, **mars_kwargs)
        _refuse_unsupported(base, kwargs, settings)
        if settings is None or settings.plain:  # plain decoding: the base model's generate(), with stats if MARS
            extra = {"streamer": streamer} if streamer is not None else {}
            out = super().generate(inputs, generation_config, logits_processor, stopping_criteria, **extra, **kwargs)
            return out if settings is None else _with_plain_stats(out, ids.shape[-1] if ids is not None else 0, base)
        criteria, config = _stop_strings_as_criterion(base, generation_config, stopping_criteria, kwargs)
        mark_user_cache(kwargs)
        decode = functools.partial(mars_decode, settings=settings, streamer=streamer)
        return super().generate(inputs, config, logits_processor, criteria, custom_generate=decode, **kwargs)

    def mars_rows(
        self,
        input_ids: torch.Tensor,
        generation_config=None,
        *,
        labels=None,
        budgets=None,
        max_rows: int | None = None,
        log: bool = False,
        **kwargs,
    ) -> Session:
        """These rows prepared exactly as `generate()` prepares its batch (the same settings, checks, logits processors
        and stopping), before their prompt's pass: what a `Runner` admits (`Runner.admit` runs that pass, into its own
        rows). `mars_session` takes the same arguments.

        Args:
            input_ids: `(rows, prompt)` prompts, left-padded (pass `attention_mask` with them).
            generation_config, **kwargs: as for `generate()`, the `mars_*` keywords included. Without MARS settings
                (or where lossless mode's tree is none) the rows decode at τ = 1, which is plain decoding.
            labels: one per row, what `rows()` and `release()` name it by (default: 0, 1, ...).
            budgets: each row's most new tokens (default: the config's `max_new_tokens` for every row; a row's is
                at most that).
            max_rows: the most rows that will decode together, rows that join later included (default: these):
                settings that depend on the batch size (`"auto"` trees and mask costs) are chosen for it.
            log: record every pass (`Runner.record()`: its τ, masks and each row's accepted tokens), as `generate()`
                records them; off by default, since a runner that lives as long as a server would keep them all.

        Stopping beyond EOS and each row's budget (stop strings, criteria, a client that leaves) is the caller's: it
        reads the rows after each pass and releases those it stops. Streamers and outputs of `generate()`'s dict
        (`return_dict_in_generate`) are `generate()`'s alone.
        """
        base = generation_config if generation_config is not None else self.generation_config
        for name in ("stop_strings", "stopping_criteria", "streamer"):
            if kwargs.get(name) is not None or getattr(base, name, None):
                raise ValueError(f"A MARS runner does not take `{name}`: its caller stops rows (`Runner.release`).")
        mars_kwargs = {name: kwargs.pop(name) for name in list(kwargs) if name.startswith("mars_")}
        call = {name: kwargs[name] for name in CALL_KEYS if name in kwargs}
        rows = max(max_rows or 0, input_ids.shape[0])
        settings = session_settings(self, generation_config, rows, call, **mars_kwargs)
        _refuse_unsupported(base, kwargs, "mars_session")
        config = copy.deepcopy(base)
        config.return_dict_in_generate = False  # a runner keeps no rows that left
        prepared = functools.partial(prepare_rows, settings=settings, labels=labels, budgets=budgets, log=log)
        return super().generate(input_ids, config, custom_generate=prepared, **kwargs)

    def mars_session(
        self,
        input_ids: torch.Tensor,
        generation_config=None,
        *,
        capacity: int | None = None,
        compile_config=None,
        logprobs: int | None = None,
        **kwargs,
    ) -> Runner:
        """MARS decoding of these rows, stepped by the caller (a server, the Space), in a `Runner` of their own
        (`runner.py`: the pass that `generate()` runs). Their prompt's pass runs here; then `step()` runs one pass
        for every row, `rows()` reads them (`(label, new tokens, stopped, passes)` each), `release(labels)` stops
        them, `live` says whether any is held, `admit(model.mars_rows(...))` joins rows of the same settings between
        passes, `record()` (with `log=True`) says what the passes did (`MARSStats`).

        Args:
            input_ids, generation_config, **kwargs: as for `mars_rows` (`labels`, `budgets`, `log` too).
            capacity: the most rows the runner holds (default: these); its static cache is sized for these prompts
                and budgets, as `generate()`'s default call sizes its own (rows that join must fit in it).
            compile_config: compile the pass (captured on CUDA); else it runs eagerly.
            logprobs: record each decided token's log probability and this many alternatives, from the prompt's pass
                on (`Runner.scored`).

        A compiled pass with processors only transformers applies is refused by name (`runner.no_runner`), where
        `generate()` decodes them in an eager one."""
        if "max_rows" in kwargs:
            raise TypeError("`mars_session` takes `capacity`, the most rows its runner holds, not `max_rows`.")
        rows = self.mars_rows(input_ids, generation_config, max_rows=capacity, **kwargs)
        rows.logprobs = logprobs
        capacity = max(capacity or 0, rows.text.sequences.shape[0])
        slots = own_cache_slots(rows, int(rows.text.budget.max()))
        runner = serving_runner(self, rows, capacity, slots, compile_config, log=rows.log)
        runner.admit(rows)
        return runner

    def mars_settings(self, generation_config=None, batch_size: int = 1, **mars_kwargs) -> dict | None:
        """What `generate(**mars_kwargs)` runs with at this batch size, defaults resolved (see `mars_settings`). Times
        nothing: `"auto"` settings read the pass costs cached here (`hf_mars.measure` times them)."""
        return mars_settings(self, generation_config, batch_size, **mars_kwargs)

    def mars_cache_length(self, prompt_length: int, max_new_tokens: int, batch_size: int = 1, **mars_kwargs) -> int:
        """The static cache slots `generate(cache_implementation="static", **mars_kwargs)` needs for this prompt length
        and budget. Set `generation_config.max_cache_len` to the largest a server will meet, and compiled passes are
        never recompiled for a larger cache (as for plain `generate()`)."""
        call = {name: mars_kwargs.pop(name) for name in CALL_KEYS if name in mars_kwargs}
        settings = resolve_settings(self, None, batch_size, call, **mars_kwargs)
        if settings is None:
            return prompt_length + max_new_tokens
        return static_cache_length(settings, prompt_length, max_new_tokens)


def session_settings(model, generation_config, rows: int, call: dict | None = None, **mars_kwargs) -> MARSSettings:
    """The settings a session of `rows` rows decodes with: `resolve_settings`', where plain decoding (no MARS setting,
    or lossless mode whose tree is none) is τ = 1, whose passes are plain decoding's."""
    settings = resolve_settings(model, generation_config, rows, call, **mars_kwargs)
    if settings is None:
        return resolve_settings(model, generation_config, 1, call, mars_tau=1.0)
    if settings.plain:
        return replace(settings, tau=1.0, verify=False, draft_candidates=1, lookup=0, accept="exact")
    return settings


def static_cache_length(settings: MARSSettings, prompt_length: int, max_new_tokens: int, candidates=None, lookup=None):
    """Static cache slots a MARS generation needs: the text, and `SPARE_PASSES` passes' width. A pass writes
    `[pending | drafts | masks]` whatever it accepts (B pending slots in τ-mode; the root, the full draft tree and a
    group of masks after each in lossless mode), leaving holes; the cache squeezes them out when a pass would not fit
    (`compact_static`), which the spare passes make rare. Attention reads every slot of a static cache in every
    pass, so no more are asked for. `candidates`, `lookup`: what lossless mode's tree really has (they may be fewer
    than asked, see `_prepare`)."""
    if candidates is not None or lookup is not None:
        candidates = settings.draft_candidates if candidates is None else candidates
        settings = replace(settings, draft_candidates=candidates, lookup=settings.lookup if lookup is None else lookup)
    per_pass = 1 + settings.drafts_per_pass
    groups = per_pass if settings.verify else 1  # groups of masks: after the root and after each draft
    return prompt_length + max_new_tokens + SPARE_PASSES * (per_pass + groups * (settings.block_size - 1))


def _rows(ids) -> int:
    """The batch size of a `generate()` call's input ids (1 where they are not a batch)."""
    return ids.shape[0] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else 1


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


def _refuse_unsupported(base, kwargs, settings: MARSSettings | str | None) -> None:
    """What MARS decoding cannot combine with, refused naming the MARS argument that turned it on (`settings`: a
    call's, or the name itself; None: plain `generate()`, which refuses nothing here)."""
    if settings is None:
        return
    mode = settings if isinstance(settings, str) else "mars_verify" if settings.verify else "mars_tau"
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
    session = _prepare(
        model, input_ids, logits_processor, criteria, generation_config, settings, streamer, model_kwargs
    )
    if streamer is not None:
        streamer.put(input_ids.cpu())
    try:
        compile_config = _compile_config(generation_config) if session.plan.compiled else None
        return _decode_in_runner(model, session, _runner_shape(session), compile_config, generation_config)
    finally:
        if getattr(session.cache, "kept_as", None):  # lent for this call: the next call of its size takes it
            keep_cache(model, session.cache.kept_as, session.cache.kv)


def prepare_rows(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    synced_gpus: bool = False,
    *,
    settings: MARSSettings,
    labels=None,
    budgets=None,
    log: bool = False,
    **model_kwargs,
) -> Session:
    """`model.mars_rows`' decoding method: what `generate()` prepared, as rows before their first pass."""
    cache = model_cache(model_kwargs)
    if cache is not None and bool(cache.get_seq_length() > 0):
        raise ValueError("Rows a runner admits start from their prompt: pass no filled cache.")
    session = _prepare(
        model, input_ids, logits_processor, stopping_criteria, generation_config, settings, None, model_kwargs, False
    )
    rows = input_ids.shape[0]
    session.labels = list(range(rows)) if labels is None else list(labels)
    if len(session.labels) != rows:
        raise ValueError(f"{len(session.labels)} labels for {rows} rows.")
    if budgets is not None:
        asked = torch.as_tensor(budgets, device=input_ids.device)
        if asked.shape != (rows,) or bool((asked < 1).any()):
            raise ValueError(f"budgets must be one positive number per row, got {budgets!r}.")
        session.text.budget = torch.minimum(asked, session.text.budget)
    session.log = log
    return session


def _runner_shape(session: Session) -> GraphShape:
    """The `GraphShape` of the runner that decodes this run on its static cache (`_cache` compiles no pass that
    `graph_shape` would refuse)."""
    batch, plan = session.text.sequences.shape[0], session.plan
    return graph_shape(session, batch, session.cache.size, runner_tree(plan), plan.compiled)


def _carry_prefix(cache, prompt_real: torch.Tensor, static: StaticMARSCache) -> None:
    """The K/V of the first tokens of every row (`cache`, a dynamic cache passed in to be continued) into the first
    slots of a runner's static cache, and its books (the slots `prompt_real` marks are real tokens): the prompt's pass
    then writes the rest of the prompt after them."""
    length = cache.get_seq_length()
    if length >= prompt_real.shape[1]:
        raise ValueError(
            f"The cache passed holds {length} tokens, the input {prompt_real.shape[1]}: pass at least one new token."
        )
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        raise ValueError("MARS decoding continues a cache of full-attention layers only (no sliding windows).")
    for mine, theirs in zip(static.kv.layers, cache.layers):
        mine.keys[:, :, :length].copy_(theirs.keys[:, :, :length])
        mine.values[:, :, :length].copy_(theirs.values[:, :, :length])
    static.commit(prompt_real[:, :length], 0)


def own_cache_slots(session: Session, budget: int) -> int:
    """The slots of a runner's own static cache for `run`'s rows and this budget: `static_cache_length`'s, rounded up
    to a multiple of `DEFAULT_SLOTS_STEP`."""
    plan = session.plan
    return _own_slots(plan.settings, session.text.prompt_length, budget, plan.candidates, plan.lookup)


def _own_slots(settings: MARSSettings, prompt_length: int, budget: int, candidates, lookup) -> int:
    size = static_cache_length(settings, prompt_length, budget, candidates, lookup)
    return -(-size // DEFAULT_SLOTS_STEP) * DEFAULT_SLOTS_STEP


def _compile_config(generation_config) -> CompileConfig:
    """The `CompileConfig` `generate()` compiles with (its default where the config has none)."""
    return generation_config.compile_config or CompileConfig()


def _decode_in_runner(model, session: Session, shape: GraphShape, compile_config, generation_config):
    """Decode every row with a `Runner` over the run's static cache: its prompt's pass (`Runner.admit`), then one
    graph pass (one graph replay under `generate()`'s compile path on CUDA) and one read of `finished` per pass, then
    `generate()`'s output, read from the runner. The pass is this call's alone while it decodes (`graph_pass_for`).

    What only the host can do runs between passes, and only when asked for: stopping criteria beyond EOS and the
    length limit are called as `generate()` calls them (on the runner's text: the rows they stop take nothing
    more), and a streamer gets each pass's tokens. Each reads the device once or twice a pass."""
    with graph_pass_for(model, session.cache.kv, shape, compile_config, session.plan.processors) as g:
        runner = Runner(session.plan, g, log=True)
        runner.admit(session)
        passes = _replay(runner, session) if session.live else 0  # the prompt's pass may have ended every row
        return _finish(runner, session, passes, generation_config)


def _replay(runner: Runner, session: Session) -> int:
    """Runner passes until every row is done, the host serving stopping criteria and the streamer between them:
    the passes run."""
    g, passes, stopping, streamer = runner.graph, 0, session.stopping, session.plan.streamer
    judging = not stopping.per_row
    if judging:
        stopping.sequences = g.state.sequences  # the criteria read (and pad) the text the graph writes
    streamed = int(stopping.new_tokens[0]) if streamer is not None else 0  # a read only to stream
    if not judging and streamer is None and (g.capture or (QUEUE_AHEAD_EVERYWHERE and not g.eager)):
        return _replay_ahead(runner)  # nothing for the host between passes
    while True:
        runner.step()
        passes += 1
        if judging:
            stopping.judge(g.state.decoded, g.state.done)
            g.state.done.logical_or_(stopping.settled)
            torch.all(g.state.done, out=g.state.finished)
        if streamer is not None:  # batch 1: the pass's tokens as one chunk
            kept = stopping.new_tokens[0] if judging else g.state.decoded[0]
            streamed = stream(streamer, g.state.sequences, session.text.prompt_length, streamed, int(kept))
        if g.state.finished.item():
            return passes


# Where compiled passes are queued one ahead of the host's read (`_replay_ahead`): captured ones, on CUDA, whose device
# would otherwise wait for the host between passes. Elsewhere the pass more is only a pass more; tests turn it on.
QUEUE_AHEAD_EVERYWHERE = False


def _replay_ahead(runner: Runner) -> int:
    """Captured passes, with nothing for the host to do between them, queued one ahead: the host queues the next pass
    before it reads whether the last one finished every row (`finished`, copied behind that pass: `FinishedFlag`), so
    that on a GPU the device never waits for the host between passes. The pass queued after the last runs idle (every
    row done: it takes nothing) and is taken back (`Runner.take_back`). The passes run, that one left out."""
    finished = FinishedFlag(runner.graph.state.finished)
    runner.step()
    passes = 1
    while True:
        finished.queue()
        runner.step()
        if finished.read():
            runner.take_back()
            return passes
        passes += 1


class FinishedFlag:
    """A pass's `finished`, copied behind it: on CUDA into pinned host memory, an event recorded after the copy, so
    that reading it waits for that pass alone, not for the passes queued after it."""

    def __init__(self, finished: torch.Tensor):
        self.finished, self.cuda = finished, finished.is_cuda
        self.copy = torch.empty((), dtype=torch.bool, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None

    def queue(self) -> None:
        self.copy.copy_(self.finished, non_blocking=self.cuda)
        if self.event is not None:
            self.event.record()

    def read(self) -> bool:
        if self.event is not None:
            self.event.synchronize()
        return bool(self.copy)


def _prepare(
    model, input_ids, processors, criteria, generation_config, settings, streamer, model_kwargs, runner_cache=True
) -> Session:
    """Check what MARS can do exactly, then set up the cache (`runner_cache`: the static cache the run's runner
    decodes on, else none: rows a runner of a caller's admits into its own), the mask schedule and the stopping
    criteria."""
    batch, prompt_length = input_ids.shape
    device = input_ids.device
    processors = without_implied_minimum(processors)
    window = _check_decodable(model, generation_config, settings, prompt_length, processors)
    eos = eos_token_ids(generation_config, device)
    pad_token_id = pad_token(generation_config, eos)
    budget = generation_config.max_length - prompt_length
    room = 1 + settings.drafts_per_pass  # a pass writes this many slots past a row's tokens (pad past those taken)
    sequences = torch.full((batch, prompt_length + budget + room), pad_token_id, dtype=torch.long, device=device)
    sequences[:, :prompt_length] = input_ids
    attention_mask = model_kwargs.get("attention_mask")
    prompt_real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    do_sample, typical = generation_config.do_sample, settings.typical
    candidates, lookup = draft_shape(settings, do_sample, typical, processors)
    cache, compiled = None, False
    if runner_cache:
        shape = (settings, candidates, lookup, processors)
        cache, compiled = _cache(model, generation_config, shape, model_kwargs, prompt_real)
    cached = cache.length if cache is not None else 0  # a cache passed in holds the first tokens of every row already
    plan = Plan(
        settings=settings,
        processors=processors,
        do_sample=do_sample,
        typical=typical,
        candidates=candidates,
        lookup=lookup,
        pad_token_id=pad_token_id,
        eos=eos,
        window=window,
        compiled=compiled,
        streamer=streamer,
    )
    zeros = torch.zeros(batch, dtype=torch.long, device=device)
    everyone = torch.ones(batch, dtype=torch.bool, device=device)
    text = Text(
        prompt_length, zeros + budget, sequences, prompt_real, zeros, zeros.clone(), ~everyone, everyone, zeros.clone()
    )
    feed = Feed(input_ids[:, cached:], prompt_real[:, cached:], Drafts.none(batch, device))
    schedule = MaskSchedule(settings.mask_cost, batch, settings.block_size - 1, device)
    return Session(plan, text, feed, cache, schedule, Stopping(criteria, sequences, prompt_length, pad_token_id))


def _cache(model, generation_config, shape, model_kwargs, prompt_real) -> tuple[StaticMARSCache, bool]:
    """`(the static cache the run's runner decodes on, whether its pass is compiled)`, for `shape`: `(settings,
    candidates, lookup, processors)`. With `cache_implementation="static"`, the `StaticCache` that `generate()` made
    or was given, sized for MARS, whose passes write more slots than they keep, with `generate()`'s own helper (it
    remembers the size, so later calls reuse it and nothing recompiles). The default call (no cache asked for, or a
    dynamic one: transformers' default): one of the runner's own, `own_cache_slots` wide (K/V for the whole budget,
    held from the start); a dynamic cache passed in that holds the first tokens of every row (one a `generate()` call
    returned) is carried into its first slots and continued. Either way the runner decodes on a static cache, so
    `generate()`'s rule for one decides on compiling (on a GPU, unless `disable_compile`): the default call is the
    fast one too. Not for processors only transformers applies, which an eager pass alone calls between slots."""
    settings, candidates, lookup, processors = shape
    (batch, prompt_length), device = prompt_real.shape, prompt_real.device
    budget = generation_config.max_length - prompt_length
    cache = model_cache(model_kwargs)
    filled = cache is not None and bool(cache.get_seq_length() > 0)
    calls = processor_fields(processors)["calls"]
    if not isinstance(cache, StaticCache):
        slots = _own_slots(settings, prompt_length, budget, candidates, lookup)
        own = StaticCache(config=full_attention_config(model.config), max_cache_len=slots)  # allocated once chosen
        compiled = compiles(model, generation_config, {CACHE_ARG: own}) and not calls
        kept_as = _kept_as(model, compiled, batch, device)
        static = _runner_cache(model, (kept_as and lend_cache(model, kept_as, slots)) or own, batch, device, kept_as)
        if filled:
            _carry_prefix(cache, prompt_real, static)
        return static, compiled
    if filled:
        raise ValueError("MARS decoding starts from an empty static cache (a filled dynamic one it continues).")
    full = all(type(layer) is StaticLayer for layer in cache.layers)
    if not full and user_defined_cache(cache):
        raise ValueError("MARS decoding takes a static cache of full-attention layers only (it builds the windows).")
    size = static_cache_length(settings, prompt_length, budget, candidates, lookup)
    compiled = compiles(model, generation_config, model_kwargs) and not calls
    made = static_cache_size(cache) < size or not full  # sliding layers keep a window of slots: MARS needs them all
    if made and user_defined_cache(cache):
        raise ValueError(f"MARS decoding needs a StaticCache of at least {size} slots here (max_cache_len).")
    kept_as = None if user_defined_cache(cache) else _kept_as(model, compiled, batch, device)
    lent = lend_cache(model, kept_as, size) if kept_as else None
    if lent is not None:
        cache, made = lent, False
        model_kwargs[CACHE_ARG] = lent
    if made:
        cache = new_static_cache(model, generation_config, batch, size, model_kwargs, full_layers=not full)
    return _runner_cache(model, cache, batch, device, kept_as), compiled


def _kept_as(model, compiled: bool, batch: int, device):
    """Where a captured pass decodes: the key its static cache is kept under between calls (it writes the addresses
    it was captured on, so the cache outlives each call, lent to the next that fits: `graph.lend_cache`); else None."""
    return (batch, model.dtype, str(device)) if captured(device, compiled) else None


def _runner_cache(model, kv, batch: int, device, kept_as) -> StaticMARSCache:
    """The run's books over `kv`, its layers allocated; given back under `kept_as` when the call ends."""
    allocate_layers(kv, model, batch)
    static = StaticMARSCache(kv, batch, device)
    static.kept_as = kept_as
    return static


def _finish(runner: Runner, session: Session, passes: int, generation_config):
    """`generate()`'s output, read from the runner after its `passes` passes: the sequences, `MARSStats` (every pass's
    accepted tokens) and, where asked for, the cache as a `DynamicCache` of the text's K/V (`prefix_cache`)."""
    plan, text, state = session.plan, session.text, runner.graph.state
    if plan.streamer is not None:
        plan.streamer.end()
    # EOS and the length limit alone: each row's own count (else the criteria's, judged on the runner's text)
    new_tokens = state.decoded.clone() if session.stopping.per_row else session.stopping.new_tokens
    stats = runner.record()  # every pass's accepted tokens; a row takes a token in every pass it decodes in
    stats.new_tokens = new_tokens
    stats.passes_per_row = text.passes + (state.accepted_log[:passes] > 0).sum(dim=0)
    sequences = state.sequences[:, : text.prompt_length + int(new_tokens.max())].clone()
    if not generation_config.return_dict_in_generate:
        return sequences
    cache = None
    if generation_config.use_cache is not False:  # as `generate()`: K/V of every position but the last
        limits = (text.prompt_length + new_tokens).clamp(max=sequences.shape[1] - 1)
        tokens_at = torch.cat([text.prompt_real, text.prompt_real.new_ones(sequences.shape)], dim=1)
        real = state.real[:, : runner.slot]  # the slots the passes kept (the last pass's masks are past them)
        cache = prefix_cache(real, runner.graph.kv, tokens_at[:, : sequences.shape[1]], limits)
    return with_cache(MARSGenerateOutput, cache, sequences=sequences, mars_stats=stats)


def _check_decodable(model, generation_config, settings: MARSSettings, prompt_length: int, processors):
    """Refuse, with a reason, what MARS decoding cannot do exactly; return the model's `SlidingWindow` (or None)."""
    if settings.verify:
        check_stateless(processors, "lossless mode (mars_verify=True)")
    elif callable(settings.tau) or settings.tau < 1.0:
        check_stateless(
            processors, f"mars_tau={settings.tau!r}" if not callable(settings.tau) else "a callable mars_tau"
        )
    mode, option = generation_config.get_generation_mode(), "mars_verify" if settings.verify else "mars_tau"
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(f"`{option}` works with greedy decoding and sampling, not {mode.value} (e.g. num_beams > 1).")
    for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if getattr(generation_config, name, False):
            raise ValueError(f"`{name}` is not supported with `{option}`.")
    if generation_config.cache_implementation not in (None, "dynamic", "static"):
        raise ValueError(
            "MARS decoding runs on a dynamic cache or a static one (`cache_implementation='static'`), "
            f"not {generation_config.cache_implementation!r}."
        )
    if model.config.is_encoder_decoder:
        raise ValueError("MARS decoding needs a decoder-only causal LM.")
    if not forward_takes(model, "position_ids", "attention_mask", CACHE_ARG):
        raise ValueError(f"{type(model).__name__}.forward must take position_ids, attention_mask and {CACHE_ARG}.")
    _check_one_runner(model)
    return _check_cache_layers(model, generation_config, prompt_length, 1 + settings.drafts_per_pass)


def _check_one_runner(model) -> None:
    """What a runner's pass needs of the model: attention that takes the 4D masks it builds (holes, rows of other
    lengths, draft trees, windows counted in positions), `logits_to_keep`, and one device for its cache and books."""
    attention = getattr(model.config, "_attn_implementation", None)
    if attention not in BRANCHING:
        raise ValueError(
            f"MARS decoding builds 4D attention masks, which {attention!r} does not take: load the model with "
            f"attn_implementation= one of {BRANCHING} (or call `model.set_attn_implementation('sdpa')`)."
        )
    if not supports_logits_to_keep(model):
        raise ValueError(f"MARS decoding needs {type(model).__name__}.forward to take `logits_to_keep`.")
    devices = set(getattr(model, "hf_device_map", {}).values())
    if len(devices) > 1:
        raise ValueError(
            f"MARS decoding runs a model on one device (its runner keeps one cache and its books there); this one "
            f"spans {sorted(map(str, devices))} (`device_map`): load it on one."
        )


def _check_cache_layers(model, generation_config, prompt_length: int, slots_per_token: int) -> SlidingWindow | None:
    """Recurrent layers cannot drop masks. A sliding window is exact where MARS builds its 4D masks (counted in
    positions, since holes push slots apart); windows of several sizes only while the generation fits in the smallest.
    `slots_per_token`: the most cache slots a pass may fill per token it yields (holes included)."""
    if recurrent(model):
        raise ValueError(
            f"{type(model).__name__} has recurrent/linear-attention layers, whose state cannot drop masks."
        )
    probe = DynamicCache(config=model.config)
    sliding = [getattr(layer, "is_sliding", False) for layer in probe.layers]
    windows = {layer.sliding_window for layer, slides in zip(probe.layers, sliding) if slides}
    if not windows:
        return None
    if len(windows) == 1:
        return SlidingWindow(windows.pop(), everywhere=all(sliding))
    longest = prompt_length + (generation_config.max_length - prompt_length) * slots_per_token
    if min(windows) < longest:
        raise ValueError(
            f"Sliding-window layers of several windows ({sorted(windows)} tokens) are only exact with MARS while the "
            f"whole generation fits in the smallest; this one may reach {longest} cache slots. Lower max_new_tokens."
        )
    return None
