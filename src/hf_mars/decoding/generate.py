"""MARS decoding inside `model.generate()`: several tokens per forward pass, accepted while confident.

One pass feeds the tokens accepted in the previous pass plus B-1 `<|mask|>` tokens, through an ordinary causal
forward. Slot 0 is the output at the last real token (the ordinary next-token prediction); slot i >= 1 is the output
at mask i-1, which a MARS-trained model has learned to make a prediction of the token i places further on. (A B-th
mask would only feed the unused output after the last slot, so it is not fed.) Slot 0 is always accepted; then slots
are accepted left to right while their confidence is at least τ. With τ >= 1 no mask is fed at all: that is exactly
greedy (or sampled) autoregressive decoding, at its cost.

Lossless mode (`mars_verify`) feeds a pass's mask predictions back as drafts, a tree of them (optionally with a
branch found by prompt lookup), which the next pass verifies against the model's own predictions; that pass also
carries one group of masks after each draft, so it proposes the next drafts whatever it keeps (see `mars_decode` and
`cache.branch_visibility`).

τ is read before every pass, so it may be a number, a callable, or a `TauController` that a UI or a server changes
while a generation runs. The KV cache keeps real tokens only (see `cache.py`). Rows that finish leave the batch.

This file is copied into MARS checkpoints (trust_remote_code): it depends on torch, transformers and `cache.py` only.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache, GenerationMixin
from transformers.generation import GenerationMode
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from .cache import MARSCache, branch_visibility, draft_lineage

CONFIDENCE_MEASURES = ("probability", "entropy", "margin")
# Warpers that read only the scores, never the token history: they can score every slot of a pass in one call.
_HISTORY_FREE = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
)
# Attention implementations that take the 4D masks of lossless passes (a tree of drafts; see `mars_decode`)
_BRANCHING = ("sdpa", "eager")
# Lossless mode's prompt lookup (`mars_lookup`): the longest n-gram it matches
_LOOKUP_NGRAM = 3
# Squeeze holes out of a batched cache once they are this share of it (see `MARSCache.compact`).
_COMPACT_AT = 0.5
# Mask cost model (see `MaskSchedule`): EMA weight of each observed acceptance; pull of an unoffered mask's rate back
# toward 1 (every PROBE_EVERY-th pass of a row), which is how a row that stopped offering a mask tries it again.
_RATE_START, _RATE_STEP, _RECOVER, _PROBE_EVERY = 0.5, 0.25, 0.05, 8


class TauController:
    """A τ that may change while a generation runs: pass it as `mars_tau` and set `.tau` from anywhere.

    The decoder reads it before every acceptance test, so a slider in a UI or a load policy in a server changes the
    speed/quality trade-off of generations already in flight.
    """

    def __init__(self, tau: float = 1.0):
        self.tau = check_tau(tau)

    def __call__(self) -> float:
        return self.tau

    def __repr__(self) -> str:
        return f"TauController(tau={self.tau})"


def check_tau(tau) -> float:
    """Validate τ: a number in [0, 1]. 1 means plain autoregressive decoding; lower accepts more tokens per pass."""
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 <= float(tau) <= 1.0:
        raise ValueError(f"mars_tau must be a number in [0, 1] (1 = plain autoregressive decoding), got {tau!r}")
    return float(tau)


def read_tau(tau) -> float:
    """The current value of `mars_tau`: a number, or a callable (e.g. `TauController`) read at every pass."""
    return check_tau(tau() if callable(tau) else tau)


class MaskSchedule:
    """How many masks each row is offered in a pass: B-1 always (cost 0, the paper), or those that pay (cost > 0).

    A mask is a token the forward must process. Where a pass is bound by reading the weights (a GPU at small batch,
    a CPU's bfloat16 kernels at batch 1) it is nearly free; where the kernels for a few rows are slow (float32 on
    CPU) or the batch fills the compute, it is not: `cost[k-1]` is what a pass with k masks takes beyond a one-token
    pass, as a share of it (a number c means `c * k`). Masks pay only when their predictions are accepted. With a
    cost, each row keeps `rate[j]`, a running estimate of how often mask j is accepted when masks < j were, and is
    offered the k masks that maximise expected tokens per unit of time, `(1 + R_0 + ... + R_{k-1}) / (1 + cost_k)`,
    `R_j = rate[0] * ... * rate[j]`.
    A mask a row is not offered drifts back toward "accepted" every few passes, so the row tries it again now and then.

    Everything a row's offer depends on is its own history (its past acceptances, its own pass count), so its tokens
    never depend on the rest of the batch: batched output equals unbatched. The batch feeds at least the largest offer
    (more where a wider pass is cheaper: CPU kernels can be), and a row ignores the masks past its own (under causal
    attention they cannot change what it sees). With τ >= 1 no mask is fed.
    """

    def __init__(self, cost, batch: int, most: int, device):
        self.most = most
        costs = [float(cost) * k for k in range(1, most + 1)] if isinstance(cost, (int, float)) else list(cost)
        self.constant = not any(costs)
        self.time = torch.tensor([1.0] + [1.0 + c for c in costs], dtype=torch.float64, device=device)  # k masks
        self.rate = torch.full((batch, most), _RATE_START, dtype=torch.float64, device=device)
        self.last = torch.zeros(batch, dtype=torch.long, device=device)  # lossless: masks offered in the last pass

    def offer(self, rows: torch.Tensor) -> torch.Tensor:
        """`(len(rows),)` masks each row may use in this pass."""
        if self.constant:
            return torch.full_like(rows, self.most)
        reach = self.rate[rows].cumprod(dim=1)  # R_j: expected tokens that mask j adds
        tokens = torch.cat([torch.ones_like(reach[:, :1]), 1 + reach.cumsum(dim=1)], dim=1)  # with k masks
        return (tokens / self.time).argmax(dim=1)  # the first maximum: fewer masks on a tie

    def width(self, offered: torch.Tensor) -> int:
        """Masks to feed for these offers: the cheapest count that covers the largest."""
        need = int(offered.max()) if offered.numel() else 0
        return need if self.constant else need + int(self.time[need:].argmin())

    def update(self, rows: torch.Tensor, offered: torch.Tensor, paid: torch.Tensor, passes: torch.Tensor) -> None:
        """`rows`, in their `passes`-th pass, were offered `offered` masks, of which the first `paid` were accepted."""
        if self.constant:
            return
        depth = torch.arange(self.most, device=rows.device)
        seen = depth < torch.minimum(offered, paid + 1)[:, None]  # offered, and every mask before it was accepted
        rate = self.rate[rows]
        rate = torch.where(seen, (1 - _RATE_STEP) * rate + _RATE_STEP * (depth < paid[:, None]).double(), rate)
        recover = (depth >= offered[:, None]) & (passes % _PROBE_EVERY == 0)[:, None]
        self.rate[rows] = torch.where(recover, rate + _RECOVER * (1 - rate), rate)


@dataclass
class MARSStats:
    """What MARS decoding did. Every forward pass counts, the first (prefill) one included, since it yields tokens.

    Attributes:
        forward_passes: number of model forward passes.
        new_tokens: `(batch,)` tokens generated per row.
        passes_per_row: `(batch,)` forward passes each row took part in (a finished row leaves the batch).
        accepted_per_step: one `(batch,)` tensor per pass: tokens accepted by each row (0 once it has finished).
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


def confidence(probs: torch.Tensor, tokens: torch.Tensor, measure: str = "probability") -> torch.Tensor:
    """Confidence in [0, 1] of each chosen token, compared with τ.

    - "probability": the chosen token's probability (the paper's default);
    - "margin": top-1 minus top-2 probability;
    - "entropy": 1 - H(p) / log|V|, so that accepting `>= τ` means normalised entropy `<= 1 - τ`.
    """
    if measure == "probability":
        return probs.gather(-1, tokens[..., None]).squeeze(-1)
    if measure == "margin":
        top2 = probs.topk(2, dim=-1).values
        return top2[..., 0] - top2[..., 1]
    if measure == "entropy":
        return 1.0 - torch.special.entr(probs).sum(-1) / math.log(probs.shape[-1])
    raise ValueError(f"mars_confidence must be one of {CONFIDENCE_MEASURES}, got {measure!r}")


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
        mars_verify: bool = False,
        mars_draft_candidates: int | None = None,
        mars_lookup: int | None = None,
        mars_mask_cost: float | list[float] | None = None,
        streamer=None,
        **kwargs,
    ):
        r"""`GenerationMixin.generate`, plus MARS decoding when `mars_tau` is given (or set in the generation config).

        Args:
            mars_tau (`float` or callable, *optional*):
                Confidence threshold in [0, 1]; 1 is exactly autoregressive decoding. A callable (e.g.
                `TauController`) is read before every forward pass. Defaults to `generation_config.mars_tau`; when
                neither is set, this is the base model's `generate()`, untouched (in lossless mode: τ = 0).
            mars_block_size (`int`, *optional*):
                B: at most B tokens per forward pass. Defaults to the value the model was trained with.
            mars_confidence (`str`, *optional*):
                "probability" (default), "entropy" or "margin"; see `confidence`.
            mars_verify (`bool`, *optional*, defaults to `False`):
                Lossless mode: the confident mask predictions of a pass are drafts, fed as real tokens in the next
                pass and kept only where they equal the model's own next-token prediction there (plus that
                prediction after the last match). That pass feeds one group of masks after each possible number of
                kept drafts, so that whatever it keeps, it proposes the next drafts. The output is exactly greedy
                `generate()`'s, for any τ; τ only decides how many drafts are proposed (and so how wide a pass is).
                With sampling, drafts are accepted by speculative sampling, so the output is distributed exactly as
                the model's own samples. "Exactly" holds as far as a pass
                over several tokens computes the logits of one-token passes: in float32 it does (no argmax differed
                in 494 positions measured); in bfloat16 the kernels round differently for a few rows and near-ties
                flip (9 of 484 positions), so long outputs can part from `generate()`'s, as with prompt lookup.
            mars_draft_candidates (`int`, *optional*):
                Lossless mode, greedy: how many candidates the first draft gets (the first mask's top tokens), each
                verified in the same pass with its own group of masks. More make a wider pass that accepts more
                tokens: on a 2-core CPU in bfloat16, `mars_block_size=2, mars_draft_candidates=3` was fastest. With
                sampling, or a logits processor that reads the history, drafts stay a chain (1). Default: 1.
            mars_lookup (`int`, *optional*):
                Lossless mode, greedy: also draft up to this many tokens by prompt lookup, i.e. the tokens that
                followed the last occurrence of the text's final n-gram (n = 3, 2, 1) earlier in the prompt or the
                output, as one more branch of the draft tree, verified in the same pass. It pays where text repeats
                (code, maths, quotes of the prompt); on a 2-core CPU in bfloat16, `mars_block_size=2,
                mars_draft_candidates=3, mars_lookup=4` was fastest. Ignored where drafts stay a chain. Default: 0.
            mars_mask_cost (`float` or list of `float`, *optional*):
                What masks add to the time of a pass, as a share of a one-token pass: c per mask, or a list whose
                (k-1)-th entry is the cost of a pass with k masks (`hf_mars.bench.measure_mask_cost` measures it; on
                a 2-core CPU at batch 1 it read [0.70, 1.06, 0.69] in float32, [0.03, 0.00, 0.05] in bfloat16).
                0 (default): B-1 masks in every pass, as the paper. With a cost, each row is offered only the masks
                whose expected accepted tokens are worth their time, estimated from its own recent passes (see
                `MaskSchedule`), so text the masks cannot predict stays near AR speed. Lossless mode stays exact.
                Defaults to `generation_config.mars_mask_cost`.

        With `return_dict_in_generate=True` the result is a `MARSGenerateOutput` whose `mars_stats` counts forward
        passes and accepted tokens. Works with greedy decoding and sampling (`do_sample`, temperature, top_k, top_p
        and the other logits processors), EOS ids, `max_new_tokens`, `stop_strings` (pass `tokenizer=`) and
        streamers (each pass's accepted tokens arrive as one chunk).

        In lossless mode, `mars_tau`, `mars_block_size`, `mars_draft_candidates`, `mars_lookup` and `mars_mask_cost`
        not given come first from `generation_config.mars_lossless` (a dict, or dicts by batch size: `hf-mars tune`
        measures the fastest tree for a machine and saves it there), then from the defaults above (see
        `mars_settings`; `model.mars_settings(...)` shows what a call will run with).
        """
        base = generation_config if generation_config is not None else self.generation_config
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        batch_size = ids.shape[0] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else 1
        settings = mars_settings(self, base, batch_size, mars_tau=mars_tau, mars_block_size=mars_block_size,
                                 mars_confidence=mars_confidence, mars_verify=mars_verify,
                                 mars_draft_candidates=mars_draft_candidates, mars_lookup=mars_lookup,
                                 mars_mask_cost=mars_mask_cost)  # fmt: skip
        if settings is None:
            extra = {"streamer": streamer} if streamer is not None else {}
            return super().generate(inputs, generation_config, logits_processor, stopping_criteria, **extra, **kwargs)
        for name in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit"):
            if kwargs.get(name) is not None or getattr(base, name, None) is not None:
                raise ValueError(f"`mars_tau` cannot be combined with assisted decoding (`{name}`).")
        if "inputs_embeds" in kwargs:
            raise ValueError("MARS decoding needs `input_ids`, not `inputs_embeds`.")

        # `generate` hands a callable decoder no tokenizer, so stop strings are turned into a criterion here.
        stop_strings = kwargs.pop("stop_strings", None) or getattr(base, "stop_strings", None)
        tokenizer = kwargs.pop("tokenizer", None)
        if stop_strings:
            if tokenizer is None:
                raise ValueError("Stop strings need the model's tokenizer: pass `tokenizer=` to `generate`.")
            stopping_criteria = StoppingCriteriaList(stopping_criteria or [])
            stopping_criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
            if getattr(base, "stop_strings", None):
                generation_config = copy.deepcopy(base)
                generation_config.stop_strings = None

        decode = functools.partial(mars_decode, **settings, streamer=streamer)
        return super().generate(inputs, generation_config, logits_processor, stopping_criteria, custom_generate=decode, **kwargs)

    def mars_settings(self, generation_config=None, batch_size: int = 1, **mars_kwargs) -> dict | None:
        """What `generate(**mars_kwargs)` runs with at this batch size, defaults resolved (see `mars_settings`)."""
        return mars_settings(self, generation_config, batch_size, **mars_kwargs)


# Lossless mode's own defaults, read from `generation_config.mars_lossless` (see `mars_settings`)
LOSSLESS_KEYS = ("mars_tau", "mars_block_size", "mars_draft_candidates", "mars_lookup", "mars_mask_cost")


def mars_settings(model, generation_config=None, batch_size: int = 1, **kwargs) -> dict | None:
    """The MARS settings `generate()` runs with for these `mars_*` arguments, validated; `None`: plain `generate()`.

    Each argument not given (None) falls back to the generation config's key of the same name, then to a built-in
    default. In lossless mode (`mars_verify=True`), `generation_config.mars_lossless` comes first: the draft tree
    that is fastest depends on the machine and the batch size (`hf-mars tune` measures it and saves it there), and it
    is not τ-mode's B. It is a dict over `LOSSLESS_KEYS`, or such dicts by batch size (`{"1": {...}, "4": {...}}`:
    a batch uses the entry of the largest size it reaches, else the smallest). Lossless mode's output does not depend
    on τ, so it runs without one (τ = 0: every draft is proposed, the tree's shape bounds the pass). Without τ
    anywhere, τ-mode is plain `generate()`.
    """
    base = generation_config if generation_config is not None else model.generation_config
    verify = bool(kwargs.get("mars_verify"))
    preset = lossless_preset(base, batch_size) if verify else {}

    def setting(name, default=None):
        return _first_set(kwargs.get(name), preset.get(name), getattr(base, name, None), default)

    tau = setting("mars_tau", 0.0 if verify else None)
    if tau is None:
        return None
    if not callable(tau):
        check_tau(tau)
    mask_token_id = getattr(model.config, "mars_mask_token_id", None)
    if mask_token_id is None:
        raise ValueError(
            "This model has no `<|mask|>` token id (config.mars_mask_token_id); convert it with "
            "`hf_mars.to_mars(model, tokenizer)` before decoding with `mars_tau`."
        )
    block_size = setting("mars_block_size", getattr(model.config, "mars_block_size", None))
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"mars_block_size must be an integer >= 1, got {block_size!r}")
    measure = setting("mars_confidence", "probability")
    if measure not in CONFIDENCE_MEASURES:
        raise ValueError(f"mars_confidence must be one of {CONFIDENCE_MEASURES}, got {measure!r}")
    candidates = setting("mars_draft_candidates", 1)
    if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 1:
        raise ValueError(f"mars_draft_candidates must be an integer >= 1, got {candidates!r}")
    lookup = setting("mars_lookup", 0)
    if isinstance(lookup, bool) or not isinstance(lookup, int) or lookup < 0:
        raise ValueError(f"mars_lookup must be an integer >= 0, got {lookup!r}")
    if lookup and not verify:
        raise ValueError("mars_lookup drafts tokens for lossless mode: it needs mars_verify=True.")
    mask_cost = setting("mars_mask_cost", 0.0)
    _check_mask_cost(mask_cost, block_size)
    return dict(mars_tau=tau, mars_block_size=block_size, mars_confidence=measure, mars_verify=verify,
                mars_draft_candidates=candidates, mars_lookup=lookup, mars_mask_cost=mask_cost,
                mars_mask_token_id=mask_token_id)  # fmt: skip


def lossless_preset(generation_config, batch_size: int = 1) -> dict:
    """`generation_config.mars_lossless` for this batch size (see `mars_settings`), checked; {} when there is none."""
    preset = getattr(generation_config, "mars_lossless", None) or {}
    if isinstance(preset, dict) and preset and all(isinstance(k, str) and k.isdigit() for k in preset):
        sizes = sorted(int(k) for k in preset)
        preset = preset[str(max([n for n in sizes if n <= batch_size] or sizes[:1]))]
    if not isinstance(preset, dict) or not set(preset) <= set(LOSSLESS_KEYS):
        raise ValueError(f"generation_config.mars_lossless must be a dict over {LOSSLESS_KEYS} (or such dicts by "
                         f"batch size), got {getattr(generation_config, 'mars_lossless', None)!r}")  # fmt: skip
    return preset


def _check_mask_cost(cost, block_size: int) -> None:
    costs = list(cost) if isinstance(cost, (list, tuple)) else [cost]
    if isinstance(cost, (list, tuple)) and len(costs) != block_size - 1:
        raise ValueError(f"mars_mask_cost as a list needs one cost per mask count 1..B-1 ({block_size - 1}), got {cost!r}")
    if not all(not isinstance(c, bool) and isinstance(c, (int, float)) and 0 <= c < math.inf for c in costs):
        raise ValueError(f"mars_mask_cost must be a number >= 0 or a list of them (0 = B-1 masks every pass), got {cost!r}")


def _first_set(*values):
    return next((v for v in values if v is not None), None)


def _check_decodable(model, generation_config, prompt_length: int, slots_per_token: int) -> None:
    """Refuse, with a reason, what MARS decoding cannot do exactly. `slots_per_token`: the most cache slots a pass
    may fill per token it yields (holes included)."""
    mode = generation_config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(f"`mars_tau` works with greedy decoding and sampling, not {mode.value} (e.g. num_beams > 1).")
    for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if getattr(generation_config, name, False):
            raise ValueError(f"`{name}` is not supported with `mars_tau`.")
    if generation_config.cache_implementation not in (None, "dynamic"):
        raise ValueError("MARS decoding keeps its own dynamic cache; unset `cache_implementation`.")
    if model.config.is_encoder_decoder:
        raise ValueError("MARS decoding needs a decoder-only causal LM.")
    accepted = inspect.signature(model.forward).parameters
    if not {"position_ids", "attention_mask", "past_key_values"} <= set(accepted):
        raise ValueError(f"{type(model).__name__}.forward must take position_ids, attention_mask and past_key_values.")
    probe = DynamicCache(config=model.config)
    if any(getattr(probe, "is_linear", [])) or any(getattr(probe, "is_dummy", [])):
        raise ValueError(f"{type(model).__name__} has recurrent/linear-attention layers, whose state cannot drop masks.")
    windows = [layer.sliding_window for layer in probe.layers if getattr(layer, "is_sliding", False)]
    # Holes push cache indices apart: a window would then see fewer real tokens.
    longest = prompt_length + (generation_config.max_length - prompt_length) * slots_per_token
    if windows and min(windows) < longest:
        raise ValueError(
            f"Sliding-window attention ({min(windows)} tokens) is only exact with MARS while the whole generation "
            f"fits in the window; this one may reach {longest} cache slots. Lower max_new_tokens."
        )


class _Histories:
    """What logits processors read: each active row's tokens laid out exactly as `generate()` lays them out (its
    left-padded prompt, then its generated tokens), within a batch as wide as at the start.

    Rows that accepted different numbers of tokens differ in length, so they are processed in groups of equal
    length; rows that finished, or are in another group, are filled with dummies and their scores dropped. This keeps
    position-aware processors (repetition penalty's `prompt_ignore_length`, n-gram bans) and those with per-row
    state exact. In the common case (no finished row, equal lengths) it is one call on `generate()`'s own input.
    """

    def __init__(self, processors, sequences, rows, lengths):
        self.processors, self.sequences, self.rows, self.lengths = processors, sequences, rows, lengths

    def __call__(self, prefix: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Processed `scores` (active rows, vocab) of the token after each row's history plus `prefix`."""
        batch, out = self.sequences.shape[0], torch.empty_like(scores)
        for length in self.lengths.unique().tolist():
            group = (self.lengths == length).nonzero().view(-1)
            rows = self.rows[group]
            ids = self.sequences.new_zeros((batch, length + prefix.shape[1]))
            ids[rows] = torch.cat([self.sequences[rows, :length], prefix[group]], dim=1)
            full = scores.new_zeros((batch, scores.shape[1])).index_copy(0, rows, scores[group])
            out[group] = self.processors(ids, full)[rows]
        return out


def _history_free(processors) -> bool:
    return all(isinstance(p, _HISTORY_FREE) for p in processors)


def _processed(logits, histories: _Histories | None, prefix):
    """Processed scores of every slot, slot j seeing the history plus `prefix[:, :j]` (tokens already fed)."""
    if histories is None:
        return logits
    batch, slots, vocab = logits.shape
    if _history_free(histories.processors):  # one call for every slot of every row
        dummy = torch.zeros(batch * slots, 1, dtype=torch.long, device=logits.device)
        return histories.processors(dummy, logits.reshape(-1, vocab)).view(batch, slots, vocab)
    return torch.stack([histories(prefix[:, :j], logits[:, j]) for j in range(slots)], dim=1)


def _choose(logits, histories: _Histories | None, do_sample: bool, measure: str, with_probs: bool = False):
    """Pick a token for every slot of a pass and score its confidence: `(tokens, confidences)`, each `(batch, slots)`,
    plus the `(batch, slots, vocab)` distributions they were drawn from when `with_probs`.

    Processors that read the token history see, for slot i, the history plus the tokens chosen for slots < i: exactly
    what they would see if those slots are accepted (and slot i matters only if they are).
    """
    vocab = logits.shape[-1]

    def pick(scores):
        if not do_sample and not with_probs and logits.shape[1] == 1:  # one slot, always accepted: plain greedy cost
            return scores.argmax(dim=-1), None, None
        probs = torch.softmax(scores, dim=-1)
        if do_sample:
            tokens = torch.multinomial(probs.reshape(-1, vocab), num_samples=1).view(probs.shape[:-1])
        else:
            tokens = scores.argmax(dim=-1)
        return tokens, confidence(probs, tokens, measure), probs

    if histories is None or _history_free(histories.processors):
        tokens, confs, probs = pick(_processed(logits, histories, None))
    else:
        tokens = logits.new_zeros(logits.shape[:2], dtype=torch.long)
        confs, probs = logits.new_zeros(logits.shape[:2]), torch.zeros_like(logits)
        for i in range(logits.shape[1]):
            tokens[:, i], conf, prob = pick(histories(tokens[:, :i], logits[:, i]))
            if conf is not None:
                confs[:, i], probs[:, i] = conf, prob
    return (tokens, confs, probs) if with_probs else (tokens, confs)


def _verify(logits, drafts, draft_real, parents: list[int], histories, proposals=None):
    """Verification of drafts: `(tokens, accepted, kept, end)`.

    `logits[:, 0]` is the output at the last pending token (the root), `logits[:, 1 + i]` the output at draft i.
    Draft i was proposed to follow `parents[i]` (-1: the root), so the output there is the model's own prediction of
    it. `end` is where the kept drafts end: 0 for the root, 1 + i for draft i.
    - Greedy: a draft matches when it equals the argmax at its parent and its parent matches. The path to the
      deepest match is kept (siblings that are equal give equal paths); the argmax at its end follows it (the
      correction, or a bonus token when the path is the longest). Each pass yields exact greedy tokens.
    - Sampling (the drafts are a chain): `proposals[:, j]` is q'_j, the distribution draft j was drawn from, zeroed
      where it would not have been proposed (confidence below τ); a zero row where nothing was. Draft j is kept with
      probability min(1, p_j(d) / q_j(d)); the token after the last kept one is drawn from max(0, p - q')
      renormalised. This is speculative sampling with a partial proposal: the tokens are distributed exactly as the
      model samples them.
    """
    scores = _processed(logits, histories, drafts)  # histories that read prefixes only come with chains
    if proposals is None:
        target = scores.argmax(dim=-1)  # (batch, 1 + drafts)
        at_parent = torch.tensor(parents, dtype=torch.long, device=drafts.device) + 1
        match = (drafts == target[:, at_parent]) & draft_real
        paths = draft_lineage(parents).to(drafts.device)  # row 1 + i: the drafts on the path to draft i
        kept = (match[:, None, :] | ~paths[1:]).all(dim=2)  # every draft on its path matches
        depth = paths[1:].sum(dim=1)
        count, end = torch.zeros_like(target[:, 0]), torch.zeros_like(target[:, 0])
        if parents:  # the path ends at the deepest kept draft (equal siblings are equal paths: either will do)
            count, deepest = (kept * depth).max(dim=1)
            end = torch.where(count > 0, deepest + 1, 0)
        kept = paths[end]
        path = [(drafts * (kept & (depth == d))).sum(dim=1) for d in range(1, max(depth.tolist(), default=0) + 1)]
        tokens = torch.stack([*path, torch.zeros_like(count)], dim=1)
        tokens.scatter_(1, count[:, None], target.gather(1, end[:, None]))
        return tokens, count + 1, kept, end
    p = torch.softmax(scores, dim=-1)
    p_draft = p[:, :-1].gather(-1, drafts[..., None]).squeeze(-1)
    q_draft = proposals[:, :-1].gather(-1, drafts[..., None]).squeeze(-1)
    match = (torch.rand_like(p_draft) * q_draft < p_draft) & draft_real
    count = match.long().cumprod(dim=1).sum(dim=1)
    at = count[:, None, None].expand(-1, 1, p.shape[-1])
    p_next, q_next = p.gather(1, at).squeeze(1), proposals.gather(1, at).squeeze(1)
    residual = (p_next - q_next).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
    target = torch.multinomial(residual, num_samples=1)
    tokens = torch.cat([drafts, target], dim=1).scatter(1, count[:, None], target)
    kept = draft_real & (torch.arange(drafts.shape[1], device=drafts.device) < count[:, None])
    return tokens, count + 1, kept, count


def _branch_attention(model, cache, mask_2d, num_pending: int, parents: list[int], num_masks: int):
    """The 4D attention mask of a lossless pass with drafts: the real slots, seen as `branch_visibility` allows, in
    the format of the model's attention implementation (the mask builders of `transformers.masking_utils`, with an
    index-based mask function: no per-pass vmap)."""
    batch, device, past = cache.real.shape[0], cache.real.device, cache.get_seq_length()
    visible = branch_visibility(num_pending, parents, num_masks, device)  # causal, among the new tokens
    width = visible.shape[0]
    seen = torch.cat([visible.new_ones(width, past), visible], dim=1)  # (queries, keys): the cache's holes aside
    build = ALL_MASK_ATTENTION_FUNCTIONS[model.config._attn_implementation]
    return build(
        batch_size=batch,
        q_length=width,
        kv_length=past + width,
        q_offset=past,
        mask_function=lambda b, h, q, kv: seen[q - past, kv],
        attention_mask=None if mask_2d is None else mask_2d.bool(),
        allow_is_causal_skip=False,
        dtype=model.dtype,
        config=model.config,
        use_vmap=False,
        device=device,
    )


def _lookup(sequences, lengths, num_tokens: int, longest_ngram: int = _LOOKUP_NGRAM):
    """Prompt lookup: for each row, the `num_tokens` tokens that followed the latest earlier occurrence of its last
    n tokens (n from `longest_ngram` down to 1, the longest that occurs), `(found, real)`; `real` is False past the
    row's text and where nothing matched. Rows are `sequences[:, :lengths]`."""
    batch, width = sequences.shape
    found = sequences.new_zeros(batch, num_tokens)
    real = torch.zeros(batch, num_tokens, dtype=torch.bool, device=sequences.device)
    done = torch.zeros(batch, dtype=torch.bool, device=sequences.device)
    for n in range(longest_ngram, 0, -1):
        last = sequences.gather(1, (lengths[:, None] - n + torch.arange(n, device=sequences.device)).clamp(min=0))
        starts = torch.arange(width - n + 1, device=sequences.device)
        hit = (sequences.unfold(1, n, 1) == last[:, None]).all(dim=2) & (starts + n < lengths[:, None])
        start = torch.where(hit, starts, -1).amax(dim=1)
        new = (start >= 0) & ~done
        index = start[:, None] + n + torch.arange(num_tokens, device=sequences.device)
        found = torch.where(new[:, None], sequences.gather(1, index.clamp(0, width - 1)), found)
        real = torch.where(new[:, None], index < lengths[:, None], real)
        done |= new
    return found, real


def _right_align(tokens, counts, pad_token_id):
    """The first `counts[i]` tokens of each row, right-aligned (left-padded) to a common width: `(tokens, real)`.

    Used for each pass's accepted tokens (the next pass's input) and for the rows' histories that stopping criteria
    read; rows of equal length give exactly `generate()`'s `input_ids`."""
    width = int(counts.max())
    index = torch.arange(width, device=tokens.device) + (counts - width)[:, None]
    real = index >= 0
    return tokens.gather(1, index.clamp(min=0)).masked_fill(~real, pad_token_id), real


def mars_decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    synced_gpus: bool = False,
    *,
    mars_tau,
    mars_block_size: int,
    mars_mask_token_id: int,
    mars_confidence: str = "probability",
    mars_verify: bool = False,
    mars_draft_candidates: int = 1,
    mars_lookup: int = 0,
    mars_mask_cost: float | list[float] = 0.0,
    streamer=None,
    **model_kwargs,
):
    """The MARS decoding loop; `generate()` calls it with prepared inputs, processors and criteria.

    Each pass feeds `[pending | drafts | masks]`: pending are committed tokens whose K/V are not cached yet
    (right-aligned), drafts are unverified guesses (lossless mode only, left-aligned), masks are up to B-1
    `<|mask|>` (as many as the largest offer of `MaskSchedule`). The drafts form a tree (`parents`): a chain from
    the masks' top tokens, plus `mars_draft_candidates - 1` runner-ups of the first as its siblings, plus a chain of
    up to `mars_lookup` tokens found by prompt lookup (`_lookup`). The masks come once after the last pending token
    and once after each draft; the group after the last kept draft saw exactly the text as it now stands, so its
    predictions are the next drafts.
    """
    batch, prompt_length = input_ids.shape
    device = input_ids.device
    # A pass yields at least one token and fills a cache slot for each fed token but the masks: in τ-mode at most B
    # (holes where a row accepted fewer), in lossless mode 1 + its drafts (holes where they were rejected)
    drafted = mars_block_size - 1 + mars_draft_candidates - 1 + mars_lookup if mars_verify else mars_block_size - 1
    _check_decodable(model, generation_config, prompt_length, 1 + drafted)
    if streamer is not None and batch > 1:
        raise ValueError("Streamers take one sequence: batch size must be 1 with `streamer`.")
    if mars_verify and getattr(model.config, "_attn_implementation", None) not in _BRANCHING:
        raise ValueError(
            f"Lossless mode (`mars_verify`) feeds drafts as a tree, which needs an attention implementation that takes "
            f"a 4D mask: one of {_BRANCHING}, not {model.config._attn_implementation!r}."
        )
    cached = model_kwargs.get("past_key_values")
    if cached is not None and cached.get_seq_length() > 0:
        raise ValueError("MARS decoding starts from an empty cache; do not pass a filled `past_key_values`.")

    eos = generation_config._eos_token_tensor
    eos = torch.empty(0, dtype=torch.long, device=device) if eos is None else eos.to(device).view(-1)
    pad = generation_config._pad_token_tensor
    pad_token_id = int(pad) if pad is not None else (int(eos[0]) if eos.numel() else 0)
    budget = generation_config.max_length - prompt_length  # what MaxLengthCriteria allows
    extra_criteria = StoppingCriteriaList(
        c for c in stopping_criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))
    )
    logits_to_keep = model._supports_logits_to_keep()

    sequences = torch.full((batch, prompt_length + budget + mars_block_size), pad_token_id, dtype=torch.long, device=device)
    sequences[:, :prompt_length] = input_ids
    new_tokens = torch.zeros(batch, dtype=torch.long, device=device)
    passes_per_row = torch.zeros(batch, dtype=torch.long, device=device)
    stats = MARSStats()
    rows = torch.arange(batch, device=device)  # the rows still generating, as indices into the batch

    attention_mask = model_kwargs.get("attention_mask")
    pending = input_ids  # committed tokens not yet in the cache, right-aligned: the prompt, then each pass's news
    pending_real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    drafts = torch.empty(batch, 0, dtype=torch.long, device=device)  # lossless mode: unverified guesses
    draft_real = torch.empty(batch, 0, dtype=torch.bool, device=device)
    parents = []  # the drafts' tree, shared by the rows: draft i follows draft parents[i] (-1: the last pending token)
    from_masks = 0  # drafts[:, :from_masks] came from masks, the rest from prompt lookup
    do_sample = generation_config.do_sample
    proposals = None  # lossless sampling: the distributions the drafts came from (see `_verify`)
    cache = MARSCache(batch, device)
    # Sibling drafts (candidates, a lookup branch) need greedy verification, whose processors (if any) read no
    # history: with sampling, or a history-reading processor, drafts stay a chain
    branching = not do_sample and (not logits_processor or _history_free(logits_processor))
    candidates = mars_draft_candidates if branching else 1
    lookup = mars_lookup if mars_verify and branching else 0
    schedule = MaskSchedule(mars_mask_cost, batch, mars_block_size - 1, device)
    if streamer is not None:
        streamer.put(input_ids.cpu())

    while rows.numel() > 0:
        tau = read_tau(mars_tau)
        offered = schedule.offer(rows) if tau < 1.0 else torch.zeros_like(rows)
        slots = 1 + schedule.width(offered)
        within = torch.arange(slots - 1, device=device) < offered[:, None]  # masks each row may use
        num_drafts = drafts.shape[1]
        # Lossless mode: one group of masks after the root and after each draft (see `MARSCache.step_inputs`)
        groups = num_drafts + 1
        masks = torch.full((rows.numel(), groups * (slots - 1)), mars_mask_token_id, dtype=torch.long, device=device)
        mask_2d, position_ids = cache.step_inputs(torch.cat([pending_real, draft_real], dim=1), slots - 1, parents)
        if num_drafts:
            mask_2d = _branch_attention(model, cache, mask_2d, pending.shape[1], parents, slots - 1)
        outputs_needed = num_drafts + 1 + groups * (slots - 1)
        extra = {"logits_to_keep": outputs_needed} if logits_to_keep else {}
        outputs = model(
            input_ids=torch.cat([pending, drafts, masks], dim=1),
            attention_mask=mask_2d,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            return_dict=True,
            **extra,
        )
        logits = outputs.logits[:, -outputs_needed:].float()
        del outputs

        lengths = prompt_length + new_tokens[rows]
        histories = _Histories(logits_processor, sequences, rows, lengths) if logits_processor else None
        # Stopping criteria read the end of each row: its tokens so far, right-aligned
        history = _right_align(sequences[rows], lengths, pad_token_id)[0] if extra_criteria else None
        if mars_verify:
            # Outputs at the last pending token and at each draft verify the drafts; the masks propose new ones.
            if do_sample and (proposals is None or proposals.shape[1] != num_drafts + 1):
                proposals = logits.new_zeros(rows.numel(), num_drafts + 1, logits.shape[-1])  # no drafts: sample p
            tokens, accepted, kept, end = _verify(
                logits[:, : num_drafts + 1], drafts, draft_real, parents, histories, proposals if do_sample else None
            )
            # The drafts before `from_masks` came from the last pass's masks: they paid what of them was kept
            schedule.update(rows, schedule.last[rows], kept[:, :from_masks].sum(dim=1), passes_per_row[rows])
            cache.commit(torch.cat([pending_real, kept], dim=1), groups * (slots - 1))  # rejected drafts: holes
        else:
            cache.commit(pending_real, slots - 1)
            tokens, confs = _choose(logits, histories, do_sample, mars_confidence)
            # Slot 0 always; then left to right while confident.
            accepted = torch.ones_like(tokens[:, 0])
            if slots > 1:
                usable = (confs[:, 1:] >= tau) & within
                accepted += usable.long().cumprod(dim=1).sum(dim=1)
            schedule.update(rows, offered, accepted - 1, passes_per_row[rows])
        schedule.last[rows] = offered

        width = tokens.shape[1]
        left = budget - new_tokens[rows]
        accepted = torch.minimum(accepted, left)
        finished = accepted >= left
        slot_index = torch.arange(width, device=device)
        is_eos = torch.isin(tokens, eos) & (slot_index < accepted[:, None])
        hit = is_eos.any(dim=1)
        accepted = torch.where(hit, is_eos.long().argmax(dim=1) + 1, accepted)
        finished |= hit
        if extra_criteria:  # stop strings, user criteria: test every accepted prefix, stop at the first that fires
            stop_at = torch.zeros_like(accepted)
            for k in range(1, int(accepted.max()) + 1):
                fired = extra_criteria(torch.cat([history, tokens[:, :k]], dim=1), None).to(device)
                stop_at = torch.where(fired & (stop_at == 0) & (k <= accepted), k, stop_at)
            accepted = torch.where(stop_at > 0, stop_at, accepted)
            finished |= stop_at > 0

        keep = slot_index < accepted[:, None]
        positions = prompt_length + new_tokens[rows][:, None] + slot_index
        sequences[rows[:, None].expand(-1, width)[keep], positions[keep]] = tokens[keep]
        new_tokens[rows] += accepted
        passes_per_row[rows] += 1
        stats.forward_passes += 1
        stats.tau_per_step.append(tau)
        stats.masks_per_step.append(slots - 1)
        stats.accepted_per_step.append(torch.zeros(batch, dtype=torch.long, device=device).index_put((rows,), accepted))
        if streamer is not None:
            streamer.put(tokens[:, : int(accepted[0])].cpu())

        if mars_verify:
            # Only the last token is new to the cache (kept drafts are in it). The group of masks that followed the
            # last kept draft saw the text as it now stands: its predictions are the next drafts, a chain (mask j's
            # top token follows mask j-1's), plus the runner-up tokens of its first mask as siblings of the first.
            pending = tokens.gather(1, (accepted - 1)[:, None])
            pending_real = torch.ones_like(pending, dtype=torch.bool)
            drafts, draft_real, parents, proposals = drafts[:, :0], draft_real[:, :0], [], None
            if slots > 1:
                if histories is not None:
                    histories.lengths = prompt_length + new_tokens[rows]  # now including this pass's tokens
                followed = logits[:, num_drafts + 1 :].unflatten(1, (groups, slots - 1))
                followed = followed[torch.arange(rows.numel(), device=device), end]
                guesses, confs, q = _choose(followed, histories, do_sample, mars_confidence, True)
                confident = (confs >= tau) & within
                count = confident.long().cumprod(dim=1).sum(dim=1)
                chain = int(count.max())  # drafts that no row proposes are not fed
                draft_real = torch.arange(chain, device=device) < count[:, None]
                drafts = guesses[:, :chain].masked_fill(~draft_real, pad_token_id)
                parents = list(range(-1, chain - 1))
                if candidates > 1 and chain:
                    rest = q[:, 0].scatter(1, guesses[:, :1], -1.0)  # not the first draft again (ties happen)
                    probs, others = rest.topk(candidates - 1, dim=-1)
                    other_real = (probs >= tau) & draft_real[:, :1]
                    if bool(other_real.any()):
                        drafts = torch.cat([drafts, others.masked_fill(~other_real, pad_token_id)], dim=1)
                        draft_real = torch.cat([draft_real, other_real], dim=1)
                        parents += [-1] * (candidates - 1)
                if do_sample:  # q' for each proposed draft and for the first position not proposed; zero after
                    by_probability = mars_confidence == "probability"
                    proposed = (q >= tau) & within[..., None] if by_probability else confident[..., None]
                    reached = torch.arange(slots - 1, device=device) <= count[:, None]
                    q = q * proposed * reached[..., None]
                    proposals = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[:, : chain + 1]
            from_masks = drafts.shape[1]
            if lookup:  # one more branch: what followed the text's last n-gram where it occurred before
                found, found_real = _lookup(sequences[rows], prompt_length + new_tokens[rows], lookup)
                reach = int(found_real.sum(dim=1).max())
                if reach:
                    drafts = torch.cat([drafts, found[:, :reach].masked_fill(~found_real[:, :reach], pad_token_id)], 1)
                    draft_real = torch.cat([draft_real, found_real[:, :reach]], dim=1)
                    parents += [-1] + list(range(from_masks, from_masks + reach - 1))
        else:
            # Next pass feeds this pass's accepted tokens, right-aligned: shorter rows leave holes in the cache.
            pending, pending_real = _right_align(tokens, accepted, pad_token_id)

        if bool(finished.any()):
            alive = (~finished).nonzero().view(-1)
            rows, pending, pending_real = rows[alive], pending[alive], pending_real[alive]
            drafts, draft_real = drafts[alive], draft_real[alive]
            proposals = None if proposals is None else proposals[alive]
            cache.keep_rows(alive)
        if rows.numel() > 1 and cache.hole_fraction() > _COMPACT_AT:
            cache.compact()

    if streamer is not None:
        streamer.end()
    stats.new_tokens, stats.passes_per_row = new_tokens, passes_per_row
    sequences = sequences[:, : prompt_length + int(new_tokens.max())]
    if generation_config.return_dict_in_generate:
        return MARSGenerateOutput(sequences=sequences, mars_stats=stats)
    return sequences
