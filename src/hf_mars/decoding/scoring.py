"""Scoring the slots of a pass: logits processors with the history each slot would have, token choice, confidence.

A pass scores several slots at once. Logits processors that read the token history (repetition penalty, n-gram bans)
must see, for each slot, the text that slot would continue if it is accepted; `Histories` lays it out exactly as
`generate()` does. Processors that read only the scores score every slot in one call.
"""

from __future__ import annotations

import math

import torch
from transformers.generation import logits_process

from .settings import CONFIDENCE_MEASURES


def _processors(*names: str) -> tuple[type, ...]:
    """The transformers processor classes of these names that this release has."""
    return tuple(getattr(logits_process, name) for name in names if hasattr(logits_process, name))


# Warpers that read only the scores, never the token history: they can score every slot of a pass in one call.
HISTORY_FREE = _processors(
    "TemperatureLogitsWarper",
    "TopKLogitsWarper",
    "TopPLogitsWarper",
    "MinPLogitsWarper",
    "TypicalLogitsWarper",
    "EpsilonLogitsWarper",
    "EtaLogitsWarper",
)
# Processors whose scores are a function of each row's token history and scores alone, recomputed at every call: MARS
# may call them for any slot of a pass, any number of times, as if that slot were `generate()`'s next step. Others
# (user-written ones, or those with state of their own, such as classifier-free guidance, which runs the model on a
# cache of its own, or SynthID's watermark) are exact only when called once per token, as at τ = 1.
STATELESS = HISTORY_FREE + _processors(
    "TopHLogitsWarper",
    "MinLengthLogitsProcessor",
    "MinNewTokensLengthLogitsProcessor",
    "RepetitionPenaltyLogitsProcessor",
    "EncoderRepetitionPenaltyLogitsProcessor",
    "NoRepeatNGramLogitsProcessor",
    "EncoderNoRepeatNGramLogitsProcessor",
    "SequenceBiasLogitsProcessor",
    "NoBadWordsLogitsProcessor",
    "PrefixConstrainedLogitsProcessor",
    "ForcedBOSTokenLogitsProcessor",
    "ForcedEOSTokenLogitsProcessor",
    "InfNanRemoveLogitsProcessor",
    "ExponentialDecayLengthPenalty",
    "LogitNormalization",
    "SuppressTokensAtBeginLogitsProcessor",
    "SuppressTokensLogitsProcessor",
    "WatermarkLogitsProcessor",
)
# Processors whose scores depend only on which tokens a row's history holds (past the columns `prompt_ignore_length`
# skips: `generate()`'s left padding), not on their order, count or length: a history padded with copies of its own
# tokens scores the same, so rows of any length are scored in one call of fixed shape (`Histories`), with no read of
# the device, which the graph pass can run.
SET_BASED = _processors("RepetitionPenaltyLogitsProcessor")
# Processors that read only the history's length (EOS barred while it is short): one call of fixed shape gives each
# row its own length (`Histories`), as `generate()` gives every row the batch's.
BY_LENGTH = _processors("MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor")
# The `generate()` argument behind a processor, named in errors
PROCESSOR_OPTIONS = {
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "SynthIDTextWatermarkLogitsProcessor": "watermarking_config",
}


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


class Histories:
    """What logits processors read: each active row's tokens laid out exactly as `generate()` lays them out (its
    left-padded prompt, then its generated tokens), within a batch as wide as at the start.

    Rows that accepted different numbers of tokens differ in length, so they are processed in groups of equal
    length; rows that finished, or are in another group, show their own tokens (a finished row: its text, then
    padding, as in `generate()`) and their scores are dropped. This keeps
    position-aware processors (repetition penalty's `prompt_ignore_length`, n-gram bans) and those with per-row
    state exact. In the common case (no finished row, equal lengths) it is one call on `generate()`'s own input.
    """

    def __init__(self, processors, sequences, rows, lengths):
        """`sequences`: `(batch, width)` every row's text; `rows`: the active rows' indices in it (None: all);
        `lengths`: `(active rows,)` how far each one's history reaches."""
        self.processors, self.sequences, self.rows, self.lengths = processors, sequences, rows, lengths
        self._filled = None

    def __call__(self, prefix: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Processed `scores` (active rows, vocab) of the token after each row's history plus `prefix` (None:
        nothing after the history)."""
        if order_free(self.processors):
            return self._in_one_call(prefix, scores)
        if prefix is None:
            prefix = self.sequences.new_zeros(scores.shape[0], 0)
        batch, out = self.sequences.shape[0], torch.empty_like(scores)
        for length in self.lengths.unique().tolist():
            group = (self.lengths == length).nonzero().view(-1)
            rows = self.rows[group]
            ids = self.sequences[:, : length + prefix.shape[1]].clone()
            ids[rows] = torch.cat([self.sequences[rows, :length], prefix[group]], dim=1)
            full = scores.new_zeros((batch, scores.shape[1])).index_copy(0, rows, scores[group])
            out[group] = self.processors(ids, full)[rows]
        return out

    def _in_one_call(self, prefix: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """`__call__` for `order_free` processors: one call over the whole batch (as `generate()` calls them, for
        processors that keep a value per row), each row's history followed by copies of its last token (the same set
        of tokens, `filled`), then `prefix`, and its own length for `BY_LENGTH` processors. Rows not active show
        their first token and their scores are dropped."""
        ids, rows, after = self.filled(), self.rows, 0 if prefix is None else prefix.shape[1]
        if rows is not None:
            scores = scores.new_zeros(ids.shape[0], scores.shape[1]).index_copy(0, rows, scores)
        if after:
            if rows is not None:
                prefix = prefix.new_zeros(ids.shape[0], after).index_copy(0, rows, prefix)
            ids = torch.cat([ids, prefix], dim=1)
        for processor in self.processors:
            if isinstance(processor, BY_LENGTH):
                scores = _by_length(processor, self.row_lengths()[:, None] + after, scores)
            else:
                scores = processor(ids, scores)
        return scores if rows is None else scores[rows]

    def row_lengths(self) -> torch.Tensor:
        """Every row's history length, the whole batch's (a row not active: 1)."""
        if self.rows is None:
            return self.lengths
        return self.lengths.new_ones(self.sequences.shape[0]).index_copy(0, self.rows, self.lengths)

    def filled(self) -> torch.Tensor:
        """Every row's text to its history's end, then copies of its last token, as wide as the batch's text (rows
        not active: their first token throughout): built once, whatever prefixes follow it (a pass scores several)."""
        if self._filled is None:
            text, lengths = self.sequences, self.row_lengths()
            columns = torch.arange(text.shape[1], device=text.device)
            self._filled = torch.where(columns < lengths[:, None], text, text.gather(1, lengths[:, None] - 1))
        return self._filled


def follow_padding(processors, prompt_real: torch.Tensor) -> None:
    """`generate()` gives a repetition penalty each row's left padding to skip (`prompt_ignore_length`, one value per
    row): as rows join and leave a session, and its prompts are padded anew, it follows them."""
    for p in processors:
        if isinstance(getattr(p, "prompt_ignore_length", None), torch.Tensor):
            p.prompt_ignore_length = prompt_real.int().argmax(dim=1)


def _by_length(processor, end: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """A `BY_LENGTH` processor's rule with each row's own history length (`end`, `(rows, 1)`) where `generate()`
    reads the batch's from `input_ids.shape[-1]`: EOS barred while the row is short of the minimum."""
    if hasattr(processor, "min_new_tokens"):  # MinNewTokensLengthLogitsProcessor
        short = end - processor.prompt_length_to_skip < processor.min_new_tokens
    else:  # MinLengthLogitsProcessor
        short = end < processor.min_length
    eos = torch.isin(torch.arange(scores.shape[-1], device=scores.device), processor.eos_token_id)
    return torch.where(short & eos, -math.inf, scores)


def order_free(processors) -> bool:
    """Whether every processor reads at most the set of tokens in a row's history and its length (`SET_BASED`,
    `BY_LENGTH`, or nothing of it)."""
    return all(isinstance(p, HISTORY_FREE + SET_BASED + BY_LENGTH) for p in processors)


def history_free(processors) -> bool:
    return all(isinstance(p, HISTORY_FREE) for p in processors)


def branching(do_sample: bool, typical, processors) -> bool:
    """Whether lossless drafts may branch (sibling candidates, a lookup branch): they need greedy verification or
    typical acceptance, whose processors (if any) read no history. With speculative sampling, or a history-reading
    processor, drafts stay a chain."""
    return (not do_sample or typical is not None) and (not processors or history_free(processors))


def check_stateless(processors, mode: str) -> None:
    """Refuse, by name, a processor that MARS would call other than once per token (see `STATELESS`); `mode`: the
    setting that makes it do so, named in the error."""
    for processor in processors:
        if not isinstance(processor, STATELESS):
            name = type(processor).__name__
            label = f"`{PROCESSOR_OPTIONS[name]}` ({name})" if name in PROCESSOR_OPTIONS else name
            raise ValueError(
                f"{label} is not a logits processor MARS knows to be stateless, and {mode} scores several slots per "
                "pass, so it would not be called as generate() calls it: use mars_tau=1 or plain generate()."
            )


def processed(logits, histories: Histories | None, prefix):
    """Processed scores of every slot, slot j seeing the history plus `prefix[:, :j]` (tokens already fed)."""
    if histories is None:
        return logits
    batch, slots, vocab = logits.shape
    if history_free(histories.processors):  # one call for every slot of every row
        dummy = torch.zeros(batch * slots, 1, dtype=torch.long, device=logits.device)
        return histories.processors(dummy, logits.reshape(-1, vocab)).view(batch, slots, vocab)
    return torch.stack([histories(prefix[:, :j], logits[:, j]) for j in range(slots)], dim=1)


def draw(probs: torch.Tensor) -> torch.Tensor:
    """One token from each distribution of `probs` (`(..., vocab)`): what `torch.multinomial(probs, 1)` computes
    (ATen draws one sample as the argmax of p / q, q ~ Exp(1), from the same generator), without the validity check
    with which `multinomial` reads the device. So a seed draws `generate()`'s tokens, and a pass that draws has no
    host sync: it is captured as a CUDA graph, which `multinomial` refuses."""
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(dim=-1)


def choose(logits, histories: Histories | None, do_sample: bool, measure: str, with_probs: bool = False):
    """Pick a token for every slot of a pass and score its confidence: `(tokens, confidences)`, each `(batch, slots)`,
    plus the `(batch, slots, vocab)` distributions they were drawn from when `with_probs`.

    Processors that read the token history see, for slot i, the history plus the tokens chosen for slots < i: exactly
    what they would see if those slots are accepted (and slot i matters only if they are).
    """

    confident = with_probs or logits.shape[1] > 1  # one slot alone is always accepted: no confidence, plain's cost
    if histories is None or history_free(histories.processors):
        scores = processed(logits, histories, None)
        if not do_sample and not confident:
            return scores.argmax(dim=-1), None
        probs = torch.softmax(scores, dim=-1)
        tokens = draw(probs) if do_sample else scores.argmax(dim=-1)
    else:  # one slot after another, each seeing the tokens chosen before it
        tokens, probs = _in_order(logits, histories, do_sample, confident)
    if not confident:
        return tokens, None
    # A greedy token's probability is the largest one, exactly: one reduction instead of a gather
    confs = probs.amax(dim=-1) if measure == "probability" and not do_sample else confidence(probs, tokens, measure)
    return (tokens, confs, probs) if with_probs else (tokens, confs)


def _in_order(logits, histories: Histories, do_sample: bool, with_probs: bool):
    """`choose`'s tokens for processors that read the history, slot by slot: `(tokens, probs)`, probs only
    `with_probs`. Each slot's processed scores are what `generate()`'s next step would see after the tokens chosen
    before it."""
    chosen, distributions = [], []
    for i in range(logits.shape[1]):
        prefix = torch.stack(chosen, dim=1) if chosen else None
        scores = histories(prefix, logits[:, i])
        probs = torch.softmax(scores, dim=-1) if do_sample or with_probs else None
        chosen.append(draw(probs) if do_sample else scores.argmax(dim=-1))
        distributions.append(probs)
    tokens = torch.stack(chosen, dim=1)
    return tokens, torch.stack(distributions, dim=1) if with_probs else None
