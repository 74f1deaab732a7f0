"""Rows prepared for MARS decoding, and their prompt's pass.

One pass feeds the tokens committed by the previous pass plus B-1 `<|mask|>` tokens, through an ordinary causal
forward. Slot 0 is the output at the last real token (the ordinary next-token prediction); slot i >= 1 is the output
at mask i-1, which a MARS-trained model has learned to make a prediction of the token i places further on. Slot 0 is
always accepted; then slots are accepted left to right while their confidence is at least τ. With τ >= 1 no mask is
fed at all: that is exactly greedy (or sampled) autoregressive decoding, at its cost. Lossless mode (`mars_verify`)
feeds a pass's mask predictions back as drafts that the next pass verifies (`verify.py`).

`generate()` and `model.mars_rows` prepare a `Session` over their rows (`generate.py`): `Plan` (fixed before the first
pass), `Text` (every row's text and progress; a row decodes while `active`) and `Feed` (what the next pass feeds). A
`Runner` (`runner.py`) runs the rows' prompt's pass, `Session.prompt_pass`, which writes the prompt's K/V straight
into the runner's rows (`cache.StaticMARSCache`, a view of them), then loads what each row decodes next into its graph
pass (`graph.py`), which runs every later pass with the same scoring, verification and commit functions.

`Session.prompt_pass` is one pass of named phases: `_forward` (one pass over `[prompt | masks]`: a prompt has no
drafts), `_accept` (τ's test, or verification of no drafts: which tokens each row takes), `_commit` (write them: K/V
into the cache, tokens into the text, which the stopping criteria then judge), `_next_inputs` (what the first graph
pass feeds) and `_retire` (rows that stopped stop decoding). What differs between the modes is behind one seam,
`Plan.mode`: `TauMode` and `LosslessMode` each say what the pass accepts (`accept`: τ's test, or `verify`'s exact,
typical or sampled choice of the root token) and what the next pass feeds (`propose`: the accepted tokens, or the
first drafts from the masks and prompt lookup), so the phases hold no mode branch.

This file is copied into MARS checkpoints (trust_remote_code), with the sibling modules it imports.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from transformers.generation.logits_process import LogitsProcessorList

from .cache import StaticMARSCache
from .commit import cut, right_align, write_taken
from .schedule import MaskSchedule
from .scoring import (
    Histories,
    branching,
    choose,
    masks_taken,
    scored_at_once,
    token_logprobs,
)
from .settings import MARSSettings, read_tau
from .stopping import Stopping, stream
from .tree import NO_DRAFTS, tree_attention
from .verify import Drafts, add_lookup, propose, verify

# Attention implementations that take the 4D masks of lossless passes (a tree of drafts), built once per pass
BRANCHING = ("sdpa", "eager", "ordered")


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


@dataclass(frozen=True)
class SlidingWindow:
    """The sliding window of a model's sliding-window layers: `size` positions; `everywhere`: every layer slides (one
    mask for all), else the forward takes masks by layer type."""

    size: int
    everywhere: bool


def draft_shape(settings: MARSSettings, do_sample: bool, typical, processors) -> tuple:
    """`(candidates, lookup)` a lossless pass's drafts take: the settings', where drafts may branch
    (`scoring.branching`), else a chain (1, 0)."""
    branches = branching(do_sample, typical, processors)
    return settings.draft_candidates if branches else 1, settings.lookup if settings.verify and branches else 0


@dataclass(frozen=True)
class Plan:
    """What one generation runs with, fixed before its first pass."""

    settings: MARSSettings
    processors: LogitsProcessorList
    do_sample: bool
    typical: tuple[float, float] | None  # lossless mode: `(ε, δ)` of typical acceptance, or None (exact)
    candidates: int | tuple[int, ...]  # lossless mode: `mars_draft_candidates` (1 where drafts stay a chain)
    lookup: int  # lossless mode: tokens of prompt lookup's branch (0 where drafts stay a chain)
    pad_token_id: int
    eos: torch.Tensor
    window: SlidingWindow | None  # the model's sliding window, whose masks MARS builds (None: no sliding layers)
    compiled: bool  # the runner's pass is compiled (`generate()`'s compile path on a static cache)
    streamer: object = None

    @property
    def mode(self) -> type[TauMode] | type[LosslessMode]:
        """What accepts the prompt's pass's tokens, and what the runner's first pass feeds."""
        return LosslessMode if self.settings.verify else TauMode


@dataclass
class Text:
    """Every row of the batch: its text and how far it got. A row decodes while it is `active`; it stops being active
    once its text has `ended` (EOS or the length limit) or the stopping criteria have settled it."""

    prompt_length: int  # columns of `sequences` before the first new token (prompts are left-padded to it)
    budget: torch.Tensor  # (batch,) new tokens each row may take (what MaxLengthCriteria allows)
    sequences: torch.Tensor  # (batch, prompt + budget + room): the prompt, then each row's decoded tokens, then pad
    prompt_real: torch.Tensor  # (batch, prompt_length): which prompt positions hold tokens (not padding)
    decoded: torch.Tensor  # (batch,) new tokens decoded
    passes: torch.Tensor  # (batch,) passes each row took part in
    ended: torch.Tensor  # (batch,) rows whose text reached EOS or the length limit
    active: torch.Tensor  # (batch,) rows still decoding
    joined: torch.Tensor  # (batch,) columns of left padding not of each row's own batch (`separate_prompts`:
    # `min_length` counts a row's prompt as its own batch padded it, as `generate()` does)


@dataclass
class Feed:
    """What the next pass feeds, for every row of the batch, in order."""

    pending: torch.Tensor  # committed tokens not in the cache yet, right-aligned
    pending_real: torch.Tensor
    drafts: Drafts


@dataclass
class Session:
    """Rows prepared for MARS decoding, before their prompt's pass, which `prompt_pass` runs (a `Runner` runs it into
    its rows, then decodes on in its graph pass).

    `labels`: one per row, in order (whatever the caller names its rows by); `log`: whether every pass is recorded in
    `stats` (`generate()`'s `MARSStats`; a runner that lives as long as a server keeps no per-pass log).
    `logprobs`: where a caller sets it (a count of alternatives, 0 or more), the prompt's pass leaves in `scored` the
    log probability of every token it decided and the `logprobs` likeliest at each slot (`token_logprobs`):
    `(logprobs (rows, width), top values, top ids)`, a row's new tokens first in its slots.
    """

    plan: Plan
    text: Text
    feed: Feed
    cache: StaticMARSCache | None  # where the prompt's pass writes (a runner's rows; None before `Runner.admit`)
    schedule: MaskSchedule
    stopping: Stopping
    stats: MARSStats = field(default_factory=MARSStats)
    live: bool = True  # any row still decoding
    labels: list = field(default_factory=list)
    log: bool = True
    logprobs: int | None = None
    scored: tuple | None = None

    @torch.no_grad()
    def prompt_pass(self, model) -> None:
        """The rows' prompt's pass: its tokens are in `text` when it returns, what each row feeds next in `feed`.
        Without autograd, as `generate()` decodes (the session was prepared by it), whatever mode the caller is in."""
        this_pass = _forward(model, self, read_tau(self.plan.settings.tau))
        tokens, accepted = _accept(self, this_pass)
        _commit(self, this_pass, tokens, accepted)
        _next_inputs(self, this_pass, tokens, accepted)
        _retire(self)

    def separate_prompts(self) -> None:
        """Each row is a batch of its own: a `min_length` counts its prompt without the left padding that the
        longer prompts opened with it added (a server's requests, opened together, decode as each alone)."""
        self.text.joined = (~self.text.prompt_real).sum(dim=1)


@dataclass
class Pass:
    """One forward pass: what it fed and what came out."""

    tau: float
    offered: torch.Tensor  # (rows,) masks each row may use
    masks: int  # masks per group (the largest offer, or more where that is cheaper)
    logits: torch.Tensor  # (rows, 1 + masks, vocab): at the last prompt token, then at each mask
    histories: Histories | None
    every_mask: bool = False  # every row may use every mask fed (no schedule, τ < 1)

    @property
    def on_offer(self) -> torch.Tensor | None:
        """`(rows, masks)`: which masks each row may use; None where every row may use all."""
        if self.every_mask:
            return None
        return torch.arange(self.masks, device=self.offered.device) < self.offered[:, None]


def _forward(model, session: Session, tau: float) -> Pass:
    """One forward pass over `[prompt (left-padded) | masks]`. How many masks is the cache's call (all B-1, whatever a
    row is offered, so that the first drafts have the runner's tree)."""
    plan, feed, cache = session.plan, session.feed, session.cache
    rows = feed.pending.shape[0]
    offered = session.schedule.offer() if tau < 1.0 else feed.pending.new_zeros(rows)
    masks = cache.masks_per_group(session.schedule, offered, tau, plan.settings.verify and not plan.do_sample)
    mask_2d, position_ids = cache.step_inputs(feed.pending_real, masks)
    attention_mask = _attention_mask(model, session, mask_2d, masks, position_ids)
    mask_ids = feed.pending.new_full((rows, masks), plan.settings.mask_token_id)
    needed = 1 + masks
    input_ids = torch.cat([feed.pending, mask_ids], dim=1)
    outputs = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        **cache.forward_kwargs(input_ids.shape[1]),
        return_dict=True,
        logits_to_keep=needed,
    )
    logits = outputs.logits[:, -needed:].float()
    text, histories = session.text, None
    if plan.processors:  # every row, in order
        every = torch.arange(rows, device=logits.device)
        histories = Histories(plan.processors, text.sequences, every, text.prompt_length + text.decoded, text.joined)
    every_mask = tau < 1.0 and session.schedule.constant and masks == session.schedule.most
    return Pass(tau, offered, masks, logits, histories, every_mask=every_mask)


def _attention_mask(model, session: Session, mask_2d, masks: int, position_ids):
    """What the forward takes as its attention mask: the 2D slot map where the model's own causal mask is exact; with
    sliding-window layers, 4D masks built here, since the model would count its window in slots, which padding pushes
    apart from positions."""
    window = session.plan.window
    if window is None or mask_2d is None:
        return mask_2d
    build = functools.partial(
        tree_attention, model, session.cache, NO_DRAFTS, mask_2d, session.feed.pending.shape[1], masks
    )
    sliding = build(window=window.size, positions=position_ids)
    return sliding if window.everywhere else {"full_attention": build(), "sliding_attention": sliding}


def _accept(session: Session, this_pass: Pass) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens each row takes from this pass: `(tokens, accepted)`, as its mode decides, cut at EOS and the length
    limit (a row no longer active takes none)."""
    text = session.text
    tokens, accepted = session.plan.mode.accept(session, this_pass)
    if session.logprobs is not None:
        deciding = this_pass.logits[:, : tokens.shape[1]]  # τ-mode's slots in order; lossless mode's root
        session.scored = token_logprobs(deciding, this_pass.histories, tokens, session.logprobs)
    left, idle = text.budget - text.decoded, ~text.active
    accepted, ended = cut(tokens, accepted, left, idle, session.plan.eos)
    text.ended |= ended
    return tokens, accepted


def _commit(session: Session, this_pass: Pass, tokens: torch.Tensor, accepted: torch.Tensor) -> None:
    """Write what the pass decided: the real tokens' K/V into the cache (the masks' and rejected drafts' are dropped,
    or left as holes), the accepted tokens into the text, which the stopping criteria then judge as `generate()`
    would; stream them."""
    plan, text, feed = session.plan, session.text, session.feed
    rows, width = torch.arange(tokens.shape[0], device=tokens.device), tokens.shape[1]
    session.cache.commit(feed.pending_real, this_pass.masks)  # the prompt's K/V stay; the masks' go
    slots = torch.arange(width, device=tokens.device)
    positions = (text.prompt_length + text.decoded)[:, None] + slots  # `sequences` has room past the budget
    write_taken(text.sequences, rows[:, None], positions, tokens, slots >= accepted[:, None], plan.pad_token_id)
    text.decoded += accepted
    text.passes += text.active.long()  # idle rows take no pass
    streamed = int(session.stopping.new_tokens[0]) if plan.streamer is not None else 0
    session.stopping.judge(text.decoded, text.ended)
    session.stats.forward_passes += 1
    if session.log:
        _log(session.stats, this_pass, accepted)
    if plan.streamer is not None:  # batch 1: the row is judged as soon as it decodes
        stream(plan.streamer, text.sequences, text.prompt_length, streamed, int(session.stopping.new_tokens[0]))


def _log(stats: MARSStats, this_pass: Pass, accepted: torch.Tensor) -> None:
    """Record one pass in `stats`: its τ, its masks, what each row of the batch accepted."""
    stats.tau_per_step.append(this_pass.tau)
    stats.masks_per_step.append(this_pass.masks)
    stats.accepted_per_step.append(accepted)


def _next_inputs(session: Session, this_pass: Pass, tokens: torch.Tensor, accepted: torch.Tensor) -> None:
    """What the next pass feeds, as the mode proposes it."""
    session.plan.mode.propose(session, this_pass, tokens, accepted)


def _retire(session: Session) -> None:
    """Rows that stopped, or reached EOS or the length limit, stop decoding: they stay in the runner's rows, done
    (the pass decodes nothing for them), and feed no drafts."""
    text, feed = session.text, session.feed
    stopped = text.ended | session.stopping.settled
    text.active.copy_(~stopped)
    feed.drafts.real = feed.drafts.real & ~stopped[:, None]
    session.live = bool((~stopped).any())


class TauMode:
    """τ-mode: a pass's mask predictions are accepted left to right while their confidence is at least τ; there are
    no drafts, and the next pass feeds what was accepted."""

    @staticmethod
    def accept(session: Session, this_pass: Pass) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot 0 always, then left to right while confident. Tells the mask schedule what its masks were worth."""
        plan = session.plan
        tokens, confs = choose(this_pass.logits, this_pass.histories, plan.do_sample, plan.settings.confidence)
        masks_used = torch.zeros_like(tokens[:, 0])
        if this_pass.masks:
            masks_used = masks_taken(confs, this_pass.tau, this_pass.on_offer)
        session.schedule.update(this_pass.offered, masks_used, session.text.passes)
        return tokens, masks_used + 1

    @staticmethod
    def propose(session: Session, this_pass: Pass, tokens: torch.Tensor, accepted: torch.Tensor) -> None:
        """This pass's accepted tokens, right-aligned (shorter rows leave holes in the cache)."""
        plan, feed = session.plan, session.feed
        if tokens.shape[1] == 1:  # no masks were fed: one token each
            feed.pending, feed.pending_real = tokens, torch.ones_like(tokens, dtype=torch.bool)
            return
        feed.pending, feed.pending_real = right_align(tokens, accepted, tokens.shape[1], plan.pad_token_id)


class LosslessMode:
    """Lossless mode: the prompt's pass verifies no drafts (its root token is chosen as `verify` chooses it: greedy,
    typical or sampled), and its masks propose the first ones (`propose`, plus prompt lookup's branch)."""

    @staticmethod
    def accept(session: Session, this_pass: Pass) -> tuple[torch.Tensor, torch.Tensor]:
        """The root token. No draft was fed, so none paid for the masks the schedule offered."""
        plan, feed, schedule = session.plan, session.feed, session.schedule
        if this_pass.histories is not None:  # every slot scored at once where the processors allow it
            lineage = NO_DRAFTS.scored_lineage(this_pass.masks, this_pass.logits.device)
            scores = scored_at_once(this_pass.logits, this_pass.histories, feed.drafts.tokens, lineage)
            if scores is not None:  # the root's and the masks' (`propose`) scores
                this_pass.logits, this_pass.histories = scores, None
        tokens, accepted, kept, _ = verify(
            this_pass.logits[:, :1], feed.drafts, this_pass.histories, plan.do_sample, plan.typical
        )
        if not schedule.constant:
            schedule.update(schedule.last, kept.sum(dim=1), session.text.passes)
            schedule.last = this_pass.offered
        return tokens, accepted

    @staticmethod
    def propose(session: Session, this_pass: Pass, tokens: torch.Tensor, accepted: torch.Tensor) -> None:
        """The root token and the first drafts, proposed by the masks (their scores processed with the root's,
        `accept`, or here after the text as it now stands, for processors that read each slot's own text), in the
        runner's full tree."""
        plan, feed = session.plan, session.feed
        feed.pending = tokens[:, :1]
        feed.pending_real = torch.ones_like(feed.pending, dtype=torch.bool)
        drafts = Drafts.none(tokens.shape[0], tokens.device)
        if this_pass.masks:
            if this_pass.histories is not None:  # the text now holds the root token
                this_pass.histories = this_pass.histories.after(session.text.sequences, tokens, accepted)
            sampled = plan.do_sample and plan.typical is None  # typical acceptance verifies the greedy tree's drafts
            proposal = (
                this_pass.histories,
                this_pass.tau,
                this_pass.on_offer,
                plan.settings.confidence,
                sampled,
                plan.candidates,
            )
            drafts = propose(this_pass.logits[:, 1:], *proposal, plan.pad_token_id)
        if plan.lookup:
            lengths = session.text.prompt_length + session.text.decoded
            drafts = add_lookup(drafts, session.text.sequences, lengths, plan.lookup, plan.pad_token_id)
        feed.drafts = drafts
