"""Scoring the slots of a pass: logits processors with the history each slot would have, token choice, confidence.

A pass scores several slots at once. Logits processors that read the token history (repetition penalty, n-gram bans)
must see, for each slot, the text that slot would continue if it is accepted; `Histories` lays it out exactly as
`generate()` does. Processors that read only the scores score every slot in one call; a repetition penalty and
minimum lengths, which read only which tokens a history holds and how long it is, are applied here by transformers'
rules from those two facts, for every slot and row at once (`Histories.apply`): a pass of fixed shape, few ops. An
n-gram ban, which reads the history's last tokens, is applied here too, slot by slot, each row at its own length.
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import NamedTuple

import torch
from transformers.generation import logits_process

from .settings import CONFIDENCE_MEASURES


def _processors(*names: str) -> tuple[type, ...]:
    """The transformers processor classes of these names that this release has."""
    return tuple(getattr(logits_process, name) for name in names if hasattr(logits_process, name))


# Processors that read only the scores, never the token history, so that every slot of a pass is scored in one call:
# the warpers, and those that bar or renormalise scores (`suppress_tokens`, `remove_invalid_values`,
# `renormalize_logits`). A sequence bias of single tokens (`sequence_bias`, `bad_words_ids`) reads none either
# (`reads_scores_only`).
HISTORY_FREE = _processors(
    "TemperatureLogitsWarper",
    "TopKLogitsWarper",
    "TopPLogitsWarper",
    "MinPLogitsWarper",
    "TypicalLogitsWarper",
    "EpsilonLogitsWarper",
    "EtaLogitsWarper",
    "SuppressTokensLogitsProcessor",
    "InfNanRemoveLogitsProcessor",
    "LogitNormalization",
)
# Biases of token sequences (bad words are biased to -inf): a sequence of two tokens or more reads the text's last ones
BIASES = _processors("SequenceBiasLogitsProcessor")
# Processors whose scores are a function of each row's token history and scores alone, recomputed at every call: MARS
# may call them for any slot of a pass, any number of times, as if that slot were `generate()`'s next step. Others
# (user-written ones, or those with state of their own, such as classifier-free guidance, which runs the model on a
# cache of its own, or SynthID's watermark) are exact only when called once per token, as at τ = 1. A processor of
# another class says it is stateless in this sense by a true `mars_stateless` attribute (hf_mars's `GrammarProcessor`).
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
    "ExponentialDecayLengthPenalty",
    "SuppressTokensAtBeginLogitsProcessor",
    "WatermarkLogitsProcessor",
)
# Processors whose scores depend only on which tokens a row's history holds (past the columns `prompt_ignore_length`
# skips: `generate()`'s left padding), not on their order, count or length: `Histories.apply` applies them from that
# set, for rows of any length and every slot at once, with no read of the device, which the graph pass can run.
SET_BASED = _processors("RepetitionPenaltyLogitsProcessor")
# Processors that divide every score by one number (temperature): applied to a penalty's penalised scores and the
# scores it leaves, the result is the same as applied after the penalty's choice between them
SCALING = _processors("TemperatureLogitsWarper")
# Processors that read only the history's length (EOS barred while it is short): `Histories.apply` gives each row
# (and slot) its own length, as `generate()` gives every row the batch's.
BY_LENGTH = _processors("MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor")
# Processors that read the order of the history's last tokens: an n-gram ban bars each token that would complete an
# n-gram the history already holds. `Histories` applies it by its own rule, each row at its own length, from tensors
# of fixed shape (every slot of a chain at once, or one slot at a time where each follows the tokens chosen before
# it), which the graph pass can run.
NGRAM_BANS = _processors("NoRepeatNGramLogitsProcessor")
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

    `order_free` processors (warpers, a repetition penalty, minimum lengths) need no more than which tokens each
    history holds (`seen`) and its length: MARS applies them itself (`apply`), every row at once. Others are called
    as transformers' own on the text: rows that accepted different numbers of tokens differ in length, so they are
    processed in groups of equal length; rows that finished, or are in another group, show their own tokens (a
    finished row: its text, then padding, as in `generate()`) and their scores are dropped. This keeps
    position-aware processors (n-gram bans) and those with per-row state exact.
    """

    def __init__(
        self, processors, sequences, rows, lengths, joined=None, ids: dict | None = None, seen=None, ngrams=None
    ):
        """`sequences`: `(batch, width)` every row's text; `rows`: the active rows' indices in it (None: all);
        `lengths`: `(active rows,)` how far each one's history reaches; `joined`: `(active rows,)` the columns of
        left padding in each one's prompt that are not its own batch's (`Text.joined`: added by rows that joined
        later; None: none), which a `min_length` does not count. `ids`: where `no_ids` keeps its columns and `seen`
        the text's column indices, for a caller that makes histories every pass (a graph pass: each tensor made is an
        op of every pass). `seen`: what `seen()` would find, where the caller keeps it (a graph pass adds each
        pass's tokens to it); None: found from the text when first asked. `ngrams`: what `ngram_windows` would make
        for the n-gram bans, where the caller keeps it (a graph pass in τ-mode writes each pass's tokens into its
        text); None: made from the text when a pass asks."""
        self.processors, self.sequences, self.rows, self.lengths = processors, sequences, rows, lengths
        self.joined = joined
        self._seen, self._ids, self._ngrams = seen, {} if ids is None else ids, ngrams
        self._kept = seen is not None  # the caller's: views of it last as long as `ids`

    def __call__(self, prefix: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Processed `scores` (active rows, vocab) of the token after each row's history plus `prefix` (None:
        nothing after the history): by MARS's rules where `by_rules` holds, else by transformers' processors
        themselves, in groups of rows of equal length (for every slot at once, `order_free` ones: `slots`)."""
        if by_rules(self.processors):  # MARS's own rules, every row at its own length at once
            self.seen(scores.shape[-1])  # found once, then carried to each slot's history (`extended`)
            moved = self.extended(prefix)
            ends = moved._ends(1, None)
            return moved.apply(scores, moved.seen(scores.shape[-1]), None if ends is None else ends[:, 0])
        if prefix is None:
            prefix = self.sequences.new_zeros(scores.shape[0], 0)
        batch, out = self.sequences.shape[0], torch.empty_like(scores)
        for length in self.lengths.unique().tolist():
            group = (self.lengths == length).nonzero().view(-1)
            rows = self.rows[group]
            ids = self.sequences[:, : length + prefix.shape[1]].clone()
            ids[rows] = torch.cat([self.sequences[rows, :length], prefix[group]], dim=1)
            full = scores.new_zeros((batch, scores.shape[1])).index_copy(0, rows, scores[group])
            joined = self.joined
            if joined is not None:  # the batch's (rows outside the group are dropped)
                joined = joined.new_zeros(batch).index_copy(0, rows, joined[group])
            out[group] = self._call_processors(ids, full, joined)[rows]
        return out

    def _call_processors(self, ids: torch.Tensor, scores: torch.Tensor, joined: torch.Tensor | None) -> torch.Tensor:
        """transformers' processors on a batch's `ids`, but a `BY_LENGTH` one by its rule with each row's own length
        (`_by_length`; `joined`: `(batch,)` padding not the row's own, not counted)."""
        if not self._reads_lengths():
            return self.processors(ids, scores)
        end = ids.new_full((ids.shape[0], 1), ids.shape[1])
        for p in self.processors:
            scores = _by_length(p, end, scores, joined) if isinstance(p, BY_LENGTH) else p(ids, scores)
        return scores

    def slots(self, logits: torch.Tensor, drafts: torch.Tensor | None, lineage=None) -> torch.Tensor:
        """`order_free` processors applied to every slot of a pass at once: `(rows, slots, vocab)` scores, slot j
        after each row's history and the `drafts` that `lineage[j]` marks (`TreeTensors.lineage`: the drafts on
        node j's path, j among `[root, drafts]`). Without `drafts`, every slot after the history alone. n-gram bans
        too where the drafts are a chain (as `branching` keeps them with a ban): slot j's history is then the
        history and the first drafts, a prefix of the text with every draft written after it."""
        rows, slots, vocab = logits.shape
        if drafts is None or slots == 1:
            return self.apply(logits, [s[:, None] for s in self.seen(vocab)], self._ends(slots, None))
        on_path = torch.where(lineage, drafts[:, None, :], vocab)  # (rows, slots, drafts)
        seen = [s[:, None].expand(rows, slots, vocab + 1).scatter(2, on_path, True) for s in self.seen(vocab)]
        bans = any(isinstance(p, NGRAM_BANS) for p in self.processors)
        depths = lineage.sum(dim=1) if bans or self._reads_lengths() else None  # where a rule reads lengths
        chain = None
        if bans:  # each slot's text and length, one row each
            written = self._written(drafts)
            texts = written[:, None].expand(rows, slots, written.shape[1]).reshape(rows * slots, -1)
            chain = (texts, (self.lengths[:, None] + depths).view(-1))
        return self.apply(logits, seen, self._ends(slots, depths), chain=chain)

    def in_order(self, logits: torch.Tensor, wide: bool = False):
        """`by_rules` processors slot by slot, each slot after the history and the tokens chosen before it: a
        generator that yields slot i's processed scores `(rows, vocab)` and is then sent the token chosen there
        (`(rows, 1)`). What does not depend on those tokens is computed once for every slot: the processors before
        the first that reads the history, a leading repetition penalty's penalised scores (a slot picks them where
        its history holds the token) and a temperature right after it, and an n-gram ban's windows over a copy of
        the text, into which each chosen token is written (`_Ngrams`). `wide`: where a ban is the last processor,
        slots may keep its spare column (`(rows, vocab + 1)`, at -inf: never a greedy choice)."""
        slots, vocab = logits.shape[1:]
        reads = SET_BASED + NGRAM_BANS
        first = next((i for i, p in enumerate(self.processors) if isinstance(p, reads)), len(self.processors))
        head, tail = self.processors[:first], self.processors[first:]
        ends = self._ends(slots, torch.arange(slots, device=logits.device)) if self._reads_lengths() else None
        scores = self.apply(logits, [], ends, head)
        lead = int(bool(tail) and isinstance(tail[0], SET_BASED))  # a leading penalty: 1, its place in `seen` too
        rest, penalised = tail[lead:], _penalised(scores, tail[0].penalty) if lead else None
        while lead and slots > 1 and rest and isinstance(rest[0], SCALING):  # both sides of the penalty's choice
            scores, penalised = (scores_only(rest[0], both, self.no_ids) for both in (scores, penalised))
            rest = rest[1:]
        spare = bool(rest) and isinstance(rest[0], NGRAM_BANS)  # the first ban's spare column, added once (`banned`)
        if spare:  # at -inf: a score that no choice takes
            pad = functools.partial(torch.nn.functional.pad, pad=(0, 1), value=-math.inf)
            scores, penalised = pad(scores), None if penalised is None else pad(penalised)
        seen = self.seen(vocab) if spare else self._in_vocab(vocab)  # as wide as the slots' scores
        penalised = penalised.unbind(1) if lead else None
        bans = self._slot_bans(slots, vocab, spare, cut=not (wide and spare and len(rest) == 1))
        for i, slot in enumerate(scores.unbind(1)):
            if lead:
                slot = torch.where(seen[0], penalised[i], slot)
            slot_bans = None if bans is None else [rule[i] for rule in bans.rules]
            token = yield self.apply(slot, seen[lead:], None if ends is None else ends[:, i], rest, slot_bans)
            seen = [s.scatter(1, token, True) for s in seen]
            if bans is not None and i + 1 < slots:
                bans.text.scatter_(1, bans.columns[i], token)

    def _slot_bans(self, slots: int, vocab: int, spare: bool = False, cut: bool = True) -> _SlotBans | None:
        """`in_order`'s n-gram bans for each of `slots` slots (None: no bans). They read a copy of the text that holds
        the spare id `vocab` past each history, which each slot's chosen token then overwrites: a window that does
        not lie within a slot's history ends past it, on the spare id, and bars only the spare column. `spare`: the
        first ban's scores come with that column (`in_order` adds it once); unless `cut`, its scores keep it."""
        if not any(isinstance(p, NGRAM_BANS) for p in self.processors):
            return None
        windows = self._ngrams or self.ngram_windows(vocab)
        ends = self.lengths[:, None] + self._arange(0, slots)  # (rows, slots): each slot's history
        columns = ends.split(1, dim=1)  # (rows, 1) each
        rules = []
        for ngrams in windows:
            suffixes = ngrams.suffixes(ends, self._arange(1 - ngrams.n, 0)).unbind(1)
            first = spare and not rules
            rules.append([functools.partial(ngrams.banned, suffix=x, spare=first, cut=cut) for x in suffixes])
        return _SlotBans(windows[0].text, columns, rules)

    def ngram_windows(self, vocab: int, text: torch.Tensor | None = None) -> list[_Ngrams]:
        """Each n-gram ban's windows (`_Ngrams`) over `text`, made here as `spare_text` (None), or one the caller
        keeps so (a graph pass: made once, views of its buffer)."""
        text = self.spare_text(vocab) if text is None else text
        return [_Ngrams(p.ngram_size, text, vocab) for p in self.processors if isinstance(p, NGRAM_BANS)]

    def spare_text(self, vocab: int) -> torch.Tensor:
        """`(rows, width)`: a copy of every row's text that holds the spare id `vocab` past its history (and for ids
        past the vocabulary), which n-gram bans read slot by slot."""
        text = self.text().clamp(max=vocab)
        return text.masked_fill_(self._arange(0, text.shape[1]) >= self.lengths[:, None], vocab)

    def seen(self, vocab: int) -> list[torch.Tensor]:
        """For each `SET_BASED` processor, `(active rows, vocab + 1)`: whether each token is in the row's history
        (past the columns it skips), found once. The last column gathers ids past the vocab and skipped ones."""
        if self._seen is None:
            self._seen = []
            penalties = [p for p in self.processors if isinstance(p, SET_BASED)]
            if penalties:
                text = self.text()
                columns = self._arange(0, text.shape[1])
                past = columns >= self.lengths[:, None]  # past each history's end
                self._seen = [_held(text, self._skipped(p, columns, past), vocab) for p in penalties]
        return self._seen

    def _in_vocab(self, vocab: int) -> list[torch.Tensor]:
        """`seen()` less its last column, as wide as the scores: views, kept in `ids` where the caller keeps `seen`."""
        if not self._kept:
            return [s[:, :vocab] for s in self.seen(vocab)]
        key = ("in vocab", vocab)
        if key not in self._ids:
            self._ids[key] = [s[:, :vocab] for s in self.seen(vocab)]
        return self._ids[key]

    def apply(self, scores, seen: list, ends: torch.Tensor | None, processors=None, bans=None, chain=None):
        """`processors` (default: all), in order, on `scores` (`(..., vocab)`), by `generate()`'s rules: `seen`
        (`seen()`'s, one per `SET_BASED` processor, broadcast) the tokens each history holds, `ends` (broadcast,
        last dim 1; None without `BY_LENGTH` processors) how long each is. A repetition penalty is applied here
        from `seen`, as transformers' processor applies it from the ids: one rule for any number of slots, each
        with a history of its own. n-gram bans: `bans`, one rule per ban for the one slot scored (`in_order`);
        `chain`: over `(rows, slots, vocab)` scores, each slot's text, one row per slot, `(texts, lengths)`; neither:
        one slot, `(rows, vocab)`, after the history."""
        held, banned = iter(seen), iter(bans or ())
        for processor in self.processors if processors is None else processors:
            if isinstance(processor, SET_BASED):  # `seen` as wide as the scores (a ban may have cut a spare column)
                penalised = _penalised(scores, processor.penalty)
                scores = torch.where(next(held)[..., : scores.shape[-1]], penalised, scores)
            elif isinstance(processor, BY_LENGTH):
                scores = _by_length(processor, ends, scores, self.joined)
            elif isinstance(processor, NGRAM_BANS) and bans is not None:
                scores = next(banned)(scores)
            elif isinstance(processor, NGRAM_BANS) and chain is None:
                scores = _ngrams_banned(processor, self.text(), self.lengths, scores)
            elif isinstance(processor, NGRAM_BANS):
                scores = _ngrams_banned(processor, *chain, scores.reshape(-1, scores.shape[-1])).view_as(scores)
            else:  # reads only the scores
                scores = scores_only(processor, scores, self.no_ids)
        return scores

    def _reads_lengths(self) -> bool:
        return any(isinstance(p, BY_LENGTH) for p in self.processors)

    def _ends(self, slots: int, extra: torch.Tensor | None) -> torch.Tensor | None:
        """`(rows, slots, 1)`: each row's history length at each slot, the history's own plus `extra[j]` tokens at
        slot j (None: none); None where no processor reads it (`BY_LENGTH`)."""
        if not self._reads_lengths():
            return None
        ends = self.lengths[:, None].expand(-1, slots)
        return (ends if extra is None else ends + extra)[..., None]

    def no_ids(self, rows: int) -> torch.Tensor:
        """Token ids for a processor that reads none: one column of zeros, made once per number of rows."""
        if rows not in self._ids:
            self._ids[rows] = torch.zeros(rows, 1, dtype=torch.long, device=self.sequences.device)
        return self._ids[rows]

    def _arange(self, start: int, end: int) -> torch.Tensor:
        """`arange(start, end)` (the text's column indices, a pass's slots), made once (kept where `no_ids` keeps its
        own)."""
        key = ("arange", start, end)
        if key not in self._ids:
            self._ids[key] = torch.arange(start, end, device=self.sequences.device)
        return self._ids[key]

    def after(self, sequences: torch.Tensor, tokens: torch.Tensor, accepted: torch.Tensor) -> Histories:
        """These histories once each row has taken `tokens[:, :accepted]`, which `sequences` now holds: what the
        proposals of the pass that took them read. The tokens already found held are kept, the new ones added."""
        late = torch.arange(tokens.shape[1], device=tokens.device) >= accepted[:, None] if self._seen else None
        return self._moved(sequences, self.lengths + accepted, tokens, late)

    def _moved(self, sequences, lengths, tokens, late) -> Histories:
        """These histories over `sequences` to `lengths`, the `tokens` not `late` (None: all of them) added to the
        tokens found held."""
        moved = Histories(self.processors, sequences, self.rows, lengths, self.joined)
        if self._seen:
            vocab = self._seen[0].shape[1] - 1
            taken = tokens.clamp(max=vocab)
            if late is not None:
                taken.masked_fill_(late, vocab)
            moved._seen = [s.scatter(1, taken, True) for s in self._seen]
        return moved

    def extended(self, prefix: torch.Tensor | None) -> Histories:
        """These histories with `prefix` (`(active rows, n)`, None: nothing) written after each one: a slot's, where
        the tokens before it in the pass are `prefix` (the text has room past every history for a pass's tokens).
        The tokens found held are carried over, the prefix's added."""
        if prefix is None or not prefix.shape[1]:
            return self
        columns = self.lengths[:, None] + torch.arange(prefix.shape[1], device=prefix.device)
        if self.rows is None:
            sequences = self.sequences.scatter(1, columns, prefix)
        else:
            sequences = self.sequences.index_put((self.rows[:, None], columns), prefix)
        return self._moved(sequences, self.lengths + prefix.shape[1], prefix, None)

    def _written(self, prefix: torch.Tensor) -> torch.Tensor:
        """`(active rows, width)`: each active row's text with `prefix` written after its history."""
        columns = self.lengths[:, None] + torch.arange(prefix.shape[1], device=prefix.device)
        return self.text().scatter(1, columns, prefix)

    def text(self) -> torch.Tensor:
        """`(active rows, width)`: each active row's text (its history, then whatever the buffer holds after it)."""
        return self.sequences if self.rows is None else self.sequences[self.rows]

    def _skipped(self, penalty, columns: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        """`(rows, width)`: the columns of each row's text that `penalty` does not read: past the history, and the
        left padding its `prompt_ignore_length` skips (an int, or one per row of the batch)."""
        skip = penalty.prompt_ignore_length
        if skip is None:
            return past
        if isinstance(skip, torch.Tensor):
            skip = skip.to(columns.device)
            skip = (skip if self.rows is None else skip[self.rows])[:, None]
        return past | (columns < skip)


def _penalised(scores: torch.Tensor, penalty: float) -> torch.Tensor:
    """Every score as a repetition penalty changes it (transformers' rule): divided by the penalty, multiplied where
    negative."""
    return torch.where(scores < 0, scores * penalty, scores / penalty)


def _held(text: torch.Tensor, hidden: torch.Tensor, vocab: int) -> torch.Tensor:
    """`(rows, vocab + 1)`: the tokens of each row of `text` outside `hidden`; the last column gathers the hidden
    ones and ids past the vocab (transformers' processor drops them the same way)."""
    ids = text.clamp(max=vocab).masked_fill_(hidden, vocab)
    return torch.zeros(text.shape[0], vocab + 1, dtype=torch.bool, device=text.device).scatter_(1, ids, True)


def follow_padding(processors, prompt_real: torch.Tensor, prompt_ends: torch.Tensor | None = None) -> None:
    """`generate()` gives a repetition penalty each row's left padding to skip (`prompt_ignore_length`, one value per
    row), and a minimum of new tokens the column its prompts end at (`prompt_length_to_skip`): as rows join and leave
    a session, and its prompts are padded anew, they follow them. `prompt_ends`: where each row's prompt ends, where
    rows' texts do not share one (a server's graph rows, each from column 0); default: the padded prompts' end."""
    for p in processors:
        if isinstance(getattr(p, "prompt_ignore_length", None), torch.Tensor):
            p.prompt_ignore_length = prompt_real.int().argmax(dim=1)
        if hasattr(p, "min_new_tokens"):  # MinNewTokensLengthLogitsProcessor
            p.prompt_length_to_skip = prompt_real.shape[1] if prompt_ends is None else prompt_ends
        if getattr(p, "mars_stateless", False) and hasattr(p, "prompt_length"):  # hf_mars's `GrammarProcessor`
            p.prompt_length = prompt_real.shape[1] if prompt_ends is None else prompt_ends


def without_implied_minimum(processors):
    """`processors` less a `MinLengthLogitsProcessor` that a `MinNewTokensLengthLogitsProcessor` implies:
    `generate()` sets `min_length` to the prompt's length plus `min_new_tokens` and builds both, which bar EOS alike.
    The one left counts from where the prompts end, which `follow_padding` moves as rows join a session."""
    minimums = [p for p in processors if isinstance(p, logits_process.MinNewTokensLengthLogitsProcessor)]

    def implied(p) -> bool:
        return isinstance(p, logits_process.MinLengthLogitsProcessor) and any(
            p.min_length == m.prompt_length_to_skip + m.min_new_tokens and torch.equal(p.eos_token_id, m.eos_token_id)
            for m in minimums
        )

    kept = [p for p in processors if not implied(p)]
    return processors if len(kept) == len(processors) else type(processors)(kept)


def _by_length(processor, end: torch.Tensor, scores: torch.Tensor, joined: torch.Tensor | None) -> torch.Tensor:
    """A `BY_LENGTH` processor's rule with each row's own history length (`end`, `(rows, 1)`) where `generate()`
    reads the batch's from `input_ids.shape[-1]`: EOS barred while the row is short of the minimum. `joined`
    (`(rows,)`, None: none): left padding not of the row's own batch, which `min_length` does not count."""

    def per_row(value):
        return value.view(-1, *(1,) * (end.dim() - 1)) if isinstance(value, torch.Tensor) else value

    if hasattr(processor, "min_new_tokens"):  # MinNewTokensLengthLogitsProcessor
        # where the prompts end: one column, or one per row (`follow_padding`)
        short = end - per_row(processor.prompt_length_to_skip) < processor.min_new_tokens
    else:  # MinLengthLogitsProcessor
        short = (end if joined is None else end - per_row(joined)) < processor.min_length
    eos = torch.isin(torch.arange(scores.shape[-1], device=scores.device), processor.eos_token_id)
    return torch.where(short & eos, -math.inf, scores)


class _SlotBans(NamedTuple):
    """n-gram bans slot by slot (`Histories.in_order`): slot i's chosen token is written into `text`, a copy of
    every row's, at `columns[i]` (`(rows, 1)`: the history's end + i), where the windows of each ban's `rules[b][i]`
    (`_Ngrams.banned`, after the history and the slots before i) see it."""

    text: torch.Tensor
    columns: tuple
    rules: list


def _ngrams_banned(processor, text: torch.Tensor, ends: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """An n-gram ban's rule (`_Ngrams`) after histories `ends` long (`(rows,)`; `text`: `(rows, width)`)."""
    vocab = scores.shape[-1]
    ngrams = _Ngrams(processor.ngram_size, text.clamp(max=vocab), vocab)
    return ngrams.banned(scores, ngrams.suffixes(ends), ngrams.outside(ends))


class _Ngrams:
    """An n-gram ban's rule with each row's own history length, where transformers' processor reads the batch's from
    `input_ids.shape[-1]`: every n-gram of the history whose first n - 1 tokens are the history's last n - 1 bars
    its last token. Fixed shapes: every window of the buffer `text` is compared, and those that do not lie within
    the history count for nothing (`outside`; or `text` holds the spare id past the history, where such a window
    ends). The windows are views of `text`, made once: they see tokens written into it
    later (`Histories.in_order` writes each slot's chosen token before it asks for the next slot's bans). Ids past
    the vocabulary (a pad id no model emits) are clamped to it in `text`, the spare column that bars nothing."""

    def __init__(self, n: int, text: torch.Tensor, vocab: int):
        self.n, self.text, self.vocab = n, text, vocab
        windows = text.unfold(1, n, 1)  # (rows, width - n + 1, n): the n-gram starting at each column
        self.heads, self.tails = windows[..., :-1], windows[..., -1]
        self.row_texts = text[:, None]  # (rows, 1, width): what a suffix is gathered from

    def suffixes(self, ends: torch.Tensor, back: torch.Tensor | None = None) -> torch.Tensor:
        """`(..., 1, n - 1)`: the columns of the last n - 1 tokens of histories `ends` long (`(rows, ...)`; a history
        shorter than n bans nothing: no window lies within it). `back`: `arange(1 - n, 0)`, where the caller keeps
        it."""
        back = torch.arange(1 - self.n, 0, device=ends.device) if back is None else back
        last = ends.view(*ends.shape, 1, 1) + back
        return last.clamp(min=0)

    def outside(self, ends: torch.Tensor) -> torch.Tensor:
        """`(..., windows)`: the windows that do not lie within histories `ends` long."""
        reach = torch.arange(self.n, self.n + self.tails.shape[1], device=ends.device)  # the history a window needs
        return reach > ends[..., None]

    def banned(self, scores, suffix: torch.Tensor, outside=None, spare: bool = False, cut: bool = True):
        """`scores` `(rows, vocab)` with the tokens barred after the histories that `suffix` (`(rows, 1, n - 1)`: the
        columns of their last n - 1 tokens) and `outside` (`(rows, windows)`; None where `text` holds the spare id
        past every history) describe, at -inf. `spare`: `scores` come with the spare column (`(rows, vocab + 1)`,
        added once for every slot of a pass), barred in place; unless `cut`, returned with it."""
        last = self.row_texts.gather(2, suffix)
        other = (self.heads != last).any(dim=-1)  # windows that bar nothing
        if outside is not None:
            other |= outside
        barred = self.tails.masked_fill(other, self.vocab)  # the spare column
        scores = scores if spare else torch.nn.functional.pad(scores, (0, 1))
        scores.scatter_(1, barred, -math.inf)
        return scores[:, : self.vocab] if cut else scores


# Processor attributes that say where each row's text lies in its batch (a repetition penalty's left padding to skip,
# where a minimum of new tokens starts counting), not what the processor does: `follow_padding` moves them as rows
# join and leave a batch
ROW_LAYOUT = ("prompt_ignore_length", "prompt_length_to_skip", "prompt_length")  # the last: `GrammarProcessor`'s
# What a processor derives from its settings on its first call (a sequence bias's vocabulary-sized tensor of its
# single-token biases; a `GrammarProcessor`'s matchers, which follow each history), or holds for each row: a processor
# already called and a fresh one with the same settings do the same
DERIVED = (
    "length_1_bias",
    "multi_token_biases",
    "prepared_bias_variables",
    "_prompt",
    "_matchers",
    "_consumed",
    "_row_grammars",  # `RowGrammars`' rows: each row's own, where its rows join a batch
    "_by_key",
)


def processors_signature(processors, layout: bool = True) -> tuple:
    """What a run's logits processors are, as a `GraphShape` field: their classes and settings, tensors by value, as a
    digest of their bytes (a pass applies them as they were when it was built, so runs share a pass only where these
    are equal; a sequence bias holds one the vocabulary's size). Without `layout`, the `ROW_LAYOUT` attributes are
    left out: what rows that join one batch must share (a session applies its own processors to every row). What a
    processor derives on its first call (`DERIVED`) is left out always."""

    def value(v):
        if not isinstance(v, torch.Tensor):
            return v
        data = v.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        return ("tensor", tuple(v.shape), str(v.dtype), hashlib.blake2b(data, digest_size=16).hexdigest())

    def settings(p):
        kept = (k for k in vars(p) if k not in DERIVED and (layout or k not in ROW_LAYOUT))
        return sorted((k, value(getattr(p, k))) for k in kept)

    return tuple((type(p).__name__, repr(settings(p))) for p in processors)


def scores_only(processor, scores: torch.Tensor, no_ids) -> torch.Tensor:
    """A processor that reads the scores alone (`reads_scores_only`) on `scores` of any shape `(..., vocab)`: a
    temperature and top-k by transformers' own arithmetic (the same values, ties kept as its comparison keeps them),
    every slot at once without flattening them into rows, in fewer ops than its call (top-k's last value as one
    slice); others called on rows (`no_ids(rows)`: the token ids they do not read)."""
    if type(processor) is logits_process.TemperatureLogitsWarper:
        return scores / processor.temperature
    if type(processor) is logits_process.TopKLogitsWarper:
        last = scores.topk(min(processor.top_k, scores.shape[-1])).values[..., -1:]
        return scores.masked_fill(scores < last, processor.filter_value)
    if scores.dim() == 2:
        return processor(no_ids(scores.shape[0]), scores)
    return processor(no_ids(scores.numel() // scores.shape[-1]), scores.reshape(-1, scores.shape[-1])).view_as(scores)


def reads_scores_only(processor) -> bool:
    """Whether `processor` reads the scores alone (`HISTORY_FREE`, or a bias of single tokens: `BIASES`)."""
    if isinstance(processor, BIASES):
        return all(len(sequence) == 1 for sequence in processor.sequence_bias)
    return isinstance(processor, HISTORY_FREE)


def order_free(processors) -> bool:
    """Whether every processor reads at most the set of tokens in a row's history and its length (`SET_BASED`,
    `BY_LENGTH`, or nothing of it)."""
    return all(isinstance(p, SET_BASED + BY_LENGTH) or reads_scores_only(p) for p in processors)


def history_free(processors) -> bool:
    return all(reads_scores_only(p) for p in processors)


def by_rules(processors) -> bool:
    """Whether `Histories` applies every processor by a rule of its own, from tensors of fixed shape (`order_free`
    ones and n-gram bans), never calling transformers' processors on the text: what the graph pass can run."""
    return all(isinstance(p, NGRAM_BANS) or order_free([p]) for p in processors)


def branching(do_sample: bool, typical, processors) -> bool:
    """Whether lossless drafts may branch (sibling candidates, a lookup branch): they need greedy verification or
    typical acceptance, and processors that read at most which tokens a history holds and its length (`order_free`:
    each node's own, from the drafts on its path). With speculative sampling, or a processor that reads the text
    itself (n-gram bans), drafts stay a chain."""
    return (not do_sample or typical is not None) and (not processors or order_free(processors))


def check_stateless(processors, mode: str) -> None:
    """Refuse, by name, a processor that MARS would call other than once per token (see `STATELESS`); `mode`: the
    setting that makes it do so, named in the error."""
    for processor in processors:
        if not isinstance(processor, STATELESS) and not getattr(processor, "mars_stateless", False):
            name = type(processor).__name__
            label = f"`{PROCESSOR_OPTIONS[name]}` ({name})" if name in PROCESSOR_OPTIONS else name
            raise ValueError(
                f"{label} is not a logits processor MARS knows to be stateless, and {mode} scores several slots per "
                "pass, so it would not be called as generate() calls it: use mars_tau=1 or plain generate()."
            )


def processed(logits, histories: Histories | None, drafts=None, lineage=None):
    """Processed scores of every slot: slot j after the history and the `drafts` on its path (`lineage[j]`,
    `Histories.slots`; None: no drafts). Processors that are not `order_free` come with chains only (`branching`),
    where the drafts on slot j's path are those before it: n-gram bans are applied to every slot at once too, others
    (transformers' own) slot by slot."""
    if histories is None:
        return logits
    if history_free(histories.processors):  # every slot of every row at once
        for processor in histories.processors:
            logits = scores_only(processor, logits, histories.no_ids)
        return logits
    if order_free(histories.processors) or (drafts is not None and by_rules(histories.processors)):
        return histories.slots(logits, drafts, lineage)  # one application for every slot of every row
    return torch.stack([histories(drafts[:, :j], logits[:, j]) for j in range(logits.shape[1])], dim=1)


def scored_at_once(logits, histories: Histories | None, drafts: torch.Tensor, lineage):
    """Lossless mode's processed scores of every slot of a pass at once, `[root, drafts, groups of masks]` (`lineage`:
    `DraftTree.scored_lineage`): a node after the history and the drafts on its path, which verification reads, and a
    mask after its node's path, which the next drafts extend. The token that verification adds after the node is not
    in a mask's history (it is not known yet): drafts are proposals, and verification keeps the output exact. With
    n-gram bans the drafts are a chain (`branching`), so each slot's history is a prefix of one text. None where
    transformers' own processors must be called on each slot's text (`by_rules` fails), or where there are none."""
    if histories is None or not by_rules(histories.processors):
        return None
    return processed(logits, histories, drafts, lineage)


def token_logprobs(logits, histories: Histories | None, tokens: torch.Tensor, top: int):
    """The log probabilities of a pass's `tokens` (`(rows, width)`): slot i's token under `logits[:, i]` processed
    after the history and the tokens before it (`tokens[:, :i]`), as the slot that decided it scored it (`choose`,
    `verify`), so that, after a row's history, a token's is what plain decoding's step would give it. Returns
    `(logprobs (rows, width), top values (rows, width, top), top ids)`, the `top` most likely tokens at each slot
    (None, None where `top` is 0)."""
    width = tokens.shape[1]
    if histories is None or history_free(histories.processors):
        scores = processed(logits, histories)
    elif width == 1:  # a one-token pass: the next token after the history
        scores = histories(None, logits[:, 0])[:, None]
    else:
        before = torch.ones(width, width - 1, dtype=torch.bool, device=tokens.device).tril(-1)  # slot i: tokens < i
        scores = processed(logits, histories, tokens[:, :-1], before)
    logprobs = scores[..., : logits.shape[-1]].float().log_softmax(dim=-1)
    chosen = logprobs.gather(-1, tokens[..., None]).squeeze(-1)
    if not top:
        return chosen, None, None
    values, ids = logprobs.topk(top, dim=-1)
    return chosen, values, ids


def draw(probs: torch.Tensor) -> torch.Tensor:
    """One token from each distribution of `probs` (`(..., vocab)`): what `torch.multinomial(probs, 1)` computes
    (ATen draws one sample as the argmax of p / q, q ~ Exp(1), from the same generator), without the validity check
    with which `multinomial` reads the device. So a seed draws `generate()`'s tokens, and a pass that draws has no
    host sync: it is captured as a CUDA graph, which `multinomial` refuses."""
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(dim=-1)


def write_into(out: torch.Tensor, op, *args) -> None:
    """`op(*args, out=out)`, one kernel where a pass runs eagerly or is captured; compiled, `out.copy_(op(*args))`,
    which inductor fuses into one, since dynamo refuses `out=` a view (a graph break). A pass writes its buffers so."""
    if torch.compiler.is_compiling():
        out.copy_(op(*args))
    else:
        op(*args, out=out)


def choose(logits, histories: Histories | None, do_sample: bool, measure: str, with_probs: bool = False, noise=None):
    """Pick a token for every slot of a pass and score its confidence: `(tokens, confidences)`, each `(batch, slots)`,
    plus the `(batch, slots, vocab)` distributions they were drawn from when `with_probs`. `noise`: where slots are
    drawn one by one, a buffer for their random numbers that the caller keeps (`kept_noise`; None: made here).

    Processors that read the token history see, for slot i, the history plus the tokens chosen for slots < i: exactly
    what they would see if those slots are accepted (and slot i matters only if they are).

    A greedy token is its scores' argmax, as `generate()`'s; a greedy draft (`with_probs`, `verify.propose`) the
    argmax of its probabilities, which only a tie that softmax rounds into being tells apart (then the first).
    """

    confident = with_probs or logits.shape[1] > 1  # one slot alone is always accepted: no confidence, plain's cost
    if histories is None or history_free(histories.processors):
        scores = processed(logits, histories, None)
        if not do_sample and not confident:
            return scores.argmax(dim=-1), None
        probs = torch.softmax(scores, dim=-1)
        if with_probs and not do_sample and measure == "probability":  # drafts: token and confidence in one reduction
            confs, tokens = probs.max(dim=-1)
            return tokens, confs, probs
        tokens = draw(probs) if do_sample else scores.argmax(dim=-1)
    else:  # one slot after another, each seeing the tokens chosen before it
        tokens, probs = _in_order(logits, histories, do_sample, confident, noise)
    if not confident:
        return tokens, None
    # A greedy token's probability is the largest one, exactly: one reduction instead of a gather
    confs = probs.amax(dim=-1) if measure == "probability" and not do_sample else confidence(probs, tokens, measure)
    return (tokens, confs, probs) if with_probs else (tokens, confs)


def masks_taken(confs: torch.Tensor, tau, on_offer: torch.Tensor | None = None) -> torch.Tensor:
    """`(rows,)` masks whose tokens τ-mode takes from a pass whose slots scored `confs` (besides slot 0's, which it
    always takes): each mask's token while it and every one before it are at least `tau` confident (and, with a mask
    schedule, `within` the masks the row was offered). What the schedule learns from, one less than the tokens."""
    confident = confs[:, 1:] >= tau
    if on_offer is not None:
        confident &= on_offer
    return confident.cumprod(dim=1).sum(dim=1)


def kept_noise(slots: int, rows: int, vocab: int, device, dtype=torch.float32) -> tuple:
    """`(buffer, its slots)`: where `choose` draws the random numbers of slots drawn one by one, for a caller that
    keeps it (a graph pass: made once, its views too, drawn anew each pass)."""
    buffer = torch.empty(slots, rows, vocab, device=device, dtype=dtype)
    return buffer, buffer.unbind(0)


def _in_order(logits, histories: Histories, do_sample: bool, with_probs: bool, kept=None):
    """`choose`'s tokens for processors that read the history, slot by slot: `(tokens, probs)`, probs only
    `with_probs`. Each slot's processed scores are what `generate()`'s next step would see after the tokens chosen
    before it (`Histories.in_order`). Sampling draws every slot's random numbers at once, in the order that draws
    slot by slot take them (`draw`'s rule), into `kept` (`kept_noise`) where given."""
    processors = histories.processors
    one_by_one = order_free(processors) or (by_rules(processors) and logits.shape[1] > 1)  # else: its own call
    scored = histories.in_order(logits, wide=not do_sample) if one_by_one else _by_calls(logits, histories)
    rows, width, vocab = logits.shape
    if do_sample:  # as `draw`'s
        buffer, noise = kept or kept_noise(width, rows, vocab, logits.device, logits.dtype)
        buffer.exponential_(1)
    chosen, slots = [], []
    for i in range(width):
        scores = scored.send(chosen[-1] if chosen else None)
        probs = torch.softmax(scores, dim=-1) if do_sample else None
        chosen.append((probs / noise[i] if do_sample else scores).argmax(dim=-1, keepdim=True))
        slots.append(probs if do_sample else scores)
    tokens = torch.cat(chosen, dim=1)
    if not with_probs:
        return tokens, None
    stacked = torch.stack(slots, dim=1)  # greedy: every slot's distribution in one softmax
    if stacked.shape[-1] > vocab:  # a ban's spare column (`Histories.in_order`'s `wide`)
        stacked = stacked[..., :vocab]
    return tokens, stacked if do_sample else torch.softmax(stacked, dim=-1)


def _by_calls(logits, histories: Histories):
    """`Histories.in_order` for processors that read the text itself: the processors called on each slot's
    history."""
    chosen = []
    for i in range(logits.shape[1]):
        token = yield histories(torch.cat(chosen, dim=1) if chosen else None, logits[:, i])
        chosen.append(token)
