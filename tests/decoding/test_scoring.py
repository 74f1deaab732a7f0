"""Scoring a pass's slots: MARS's own application of the order-free processors (a repetition penalty from the set
of tokens each history holds, minimum lengths from each history's length, warpers on every slot at once) against
transformers' processors called on each slot's history, spelled out row by row."""

import functools

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from hf_mars.decoding.scoring import Histories, by_rules, choose, processed, scores_only
from hf_mars.decoding.tree import DraftTree

VOCAB, EOS, PROMPT = 12, 3, 4  # a small vocabulary, so that histories hold many of its tokens


def _processors(skip, sampled: bool, ngram: int | None = None, minimum: bool = True):
    """What `generate()` builds for a penalty, (`minimum`) `min_new_tokens`, (`ngram`) `no_repeat_ngram_size` and
    (sampling) its warpers; `skip`: the repetition penalty's `prompt_ignore_length`, one per row or an int."""
    processors = [RepetitionPenaltyLogitsProcessor(3.0, prompt_ignore_length=skip)]
    if minimum:
        processors.append(MinNewTokensLengthLogitsProcessor(PROMPT, min_new_tokens=3, eos_token_id=EOS))
    if ngram is not None:
        processors.insert(1, NoRepeatNGramLogitsProcessor(ngram))
    if sampled:
        processors += [TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)]
    return LogitsProcessorList(processors)


def _by_hand(skip, sampled: bool, text, length: int, row: int, scores, ngram: int | None = None, minimum=True):
    """transformers' processors called on one row's history `text[:length]`, as `generate()` calls them."""
    own_skip = skip[row : row + 1].clone() if isinstance(skip, torch.Tensor) else skip
    return _processors(own_skip, sampled, ngram, minimum)(text[None, :length], scores[None])[0]


def _case(seed: int):
    """A batch of 4 left-padded texts of different lengths, pad 0, and each row's skipped padding."""
    generator = torch.Generator().manual_seed(seed)
    sequences = torch.randint(4, VOCAB, (4, 10), generator=generator)
    pads = torch.tensor([0, 2, 1, 3])
    sequences[torch.arange(10) < pads[:, None]] = 0
    lengths = torch.tensor([9, 6, 8, 5])
    return generator, sequences, pads, lengths


def _path(parents: tuple, node: int) -> list[int]:
    """The drafts on node `node`'s path (among `[root, drafts]`), root first: its ancestors' and its own."""
    path, draft = [], node - 1
    while draft >= 0:
        path, draft = [draft] + path, parents[draft]
    return path


@pytest.mark.parametrize("skip_as", ["per row", "int", "none"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("active", [None, [0, 2, 3]], ids=["all rows", "some rows"])
@pytest.mark.parametrize("parents", [(-1, 0, 1, 2), (-1, 0, 0, -1, 3)], ids=["chain", "tree"])
def test_every_node_is_processed_at_once_as_generate_processes_its_history(skip_as, sampled, active, parents):
    generator, sequences, pads, lengths = _case(0)
    skip = {"per row": pads, "int": 2, "none": None}[skip_as]
    rows = None if active is None else torch.tensor(active)
    picked = torch.arange(4) if rows is None else rows
    nodes = len(parents) + 1
    logits = torch.randn(len(picked), nodes, VOCAB, generator=generator)
    drafts = torch.randint(4, VOCAB, (len(picked), nodes - 1), generator=generator)
    histories = Histories(_processors(skip, sampled), sequences, rows, lengths[picked])
    got = processed(logits, histories, drafts, DraftTree.of(parents).on("cpu").lineage)
    for i, row in enumerate(picked.tolist()):
        for j in range(nodes):
            text = torch.cat([sequences[row, : lengths[row]], drafts[i, _path(parents, j)]])
            want = _by_hand(skip, sampled, text, len(text), row, logits[i, j])
            torch.testing.assert_close(got[i, j], want, rtol=0, atol=0)
    # The premise: the penalty changed some node's top token, and the history told it which
    assert (got.argmax(-1) != logits.argmax(-1)).any()


@pytest.mark.parametrize("minimum", [True, False], ids=["a minimum after the penalty", "the warpers right after it"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_slots_chosen_in_order_see_the_tokens_chosen_before_them(sampled, minimum):
    generator, sequences, pads, lengths = _case(1)
    logits = torch.randn(4, 6, VOCAB, generator=generator) * 2
    histories = Histories(_processors(pads, sampled, minimum=minimum), sequences, None, lengths)
    torch.manual_seed(7)
    tokens, confs, probs = choose(logits, histories, sampled, "probability", True)
    torch.manual_seed(7)
    by_hand = functools.partial(_by_hand, pads, sampled, minimum=minimum)
    for j in range(6):  # generate()'s next step after each slot's history, slot after slot, drawing in turn
        scores = torch.stack(
            [
                by_hand(torch.cat([sequences[r, : lengths[r]], tokens[r, :j]]), lengths[r] + j, r, s)
                for r, s in enumerate(logits[:, j])
            ]
        )
        want_probs = torch.softmax(scores, dim=-1)
        torch.testing.assert_close(probs[:, j], want_probs)
        if sampled:
            want = (want_probs / torch.empty_like(want_probs).exponential_(1)).argmax(dim=-1)
        else:
            want = scores.argmax(dim=-1)
        assert tokens[:, j].tolist() == want.tolist()
    torch.testing.assert_close(confs, probs.gather(-1, tokens[..., None])[..., 0])
    # The premise: the tokens chosen before a slot changed what it saw, in this run
    alone = processed(logits, Histories(histories.processors, sequences, None, lengths), None)
    assert not torch.allclose(torch.softmax(alone, dim=-1), probs)


def test_histories_after_a_pass_hold_what_the_text_then_holds():
    generator, sequences, pads, lengths = _case(2)
    tokens = torch.randint(4, VOCAB, (4, 3), generator=generator)
    accepted = torch.tensor([0, 1, 3, 2])
    processors = _processors(pads, False)
    before = Histories(processors, sequences, None, lengths)
    before.seen(VOCAB)  # found once, then carried over
    text = torch.cat([sequences, torch.zeros(4, 3, dtype=torch.long)], dim=1)
    for r in range(4):
        text[r, lengths[r] : lengths[r] + accepted[r]] = tokens[r, : accepted[r]]
    moved = before.after(text, tokens, accepted)
    fresh = Histories(processors, text, None, lengths + accepted)
    assert torch.equal(moved.lengths, fresh.lengths)
    held = [[s[:, :VOCAB] for s in h.seen(VOCAB)] for h in (before, moved, fresh)]  # the last column: a sink
    assert all(torch.equal(a, b) for a, b in zip(held[1], held[2]))
    assert not torch.equal(held[0][0], held[1][0])  # the premise: a token not held before


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("active", [None, [0, 2, 3]], ids=["all rows", "some rows"])
@pytest.mark.parametrize("ngram", [1, 2, 3])
def test_an_ngram_ban_is_applied_by_its_rule_as_generate_applies_it(ngram, active, sampled):
    """`no_repeat_ngram_size` by MARS's own rule (`scoring.by_rules`: each row at its own length, no call of
    transformers' processor), with a penalty before it and a minimum after it: a chain's every slot, after the drafts
    before it, and slots chosen in order, after the tokens chosen before them, as transformers' processors score each
    slot's history row by row."""
    generator, sequences, pads, lengths = _case(3)
    sequences = torch.nn.functional.pad(sequences, (0, 6))  # room past every history for a pass's tokens
    rows = None if active is None else torch.tensor(active)
    picked = torch.arange(4) if rows is None else rows
    logits = torch.randn(len(picked), 5, VOCAB, generator=generator) * 2
    drafts = torch.randint(4, VOCAB, (len(picked), 4), generator=generator)
    chain = DraftTree.of((-1, 0, 1, 2)).on("cpu").lineage
    histories = Histories(_processors(pads, sampled, ngram), sequences, rows, lengths[picked])
    assert by_rules(histories.processors)  # scored by MARS's rules, not by transformers' processors
    got = processed(logits, histories, drafts, chain)
    tokens, _, probs = choose(logits, histories, sampled, "probability", True)

    def by_hand(after, j):  # every row's slot j after `after[:, :j]`, by transformers' processors
        texts = [torch.cat([sequences[r, : lengths[r]], after[i, :j]]) for i, r in enumerate(picked.tolist())]
        return torch.stack(
            [_by_hand(pads, sampled, t, len(t), r, s, ngram) for t, r, s in zip(texts, picked.tolist(), logits[:, j])]
        )

    for j in range(5):
        torch.testing.assert_close(got[:, j], by_hand(drafts, j), rtol=0, atol=0)
        torch.testing.assert_close(probs[:, j], torch.softmax(by_hand(tokens, j), dim=-1))
    # The premise: the ban barred tokens that the other processors leave (before the warpers, which bar many)
    scored = [
        processed(logits, Histories(_processors(pads, False, *n), sequences, rows, lengths[picked]), drafts, chain)
        for n in ((ngram,), ())
    ]
    assert (torch.isinf(scored[0]) & ~torch.isinf(scored[1])).any()


@pytest.mark.parametrize("top_k", [1, 4, VOCAB + 3])
def test_warpers_on_every_slot_at_once_are_transformers_own_values(top_k):
    """A temperature and top-k applied by `scores_only` to `(rows, slots, vocab)` scores at once give, bit for bit,
    what transformers' warpers give on each slot's row: ties at the k-th value kept as its comparison keeps them, a k
    past the vocabulary clamped."""
    generator = torch.Generator().manual_seed(7)
    scores = torch.randint(-3, 4, (3, 5, VOCAB), generator=generator).float()  # few values: many ties
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(top_k)):
        by_rows = warper(torch.zeros(15, 1, dtype=torch.long), scores.reshape(15, VOCAB)).view_as(scores)
        assert torch.equal(scores_only(warper, scores, None), by_rows), warper
    kth = scores.topk(min(top_k, VOCAB)).values[..., -1:]
    if top_k < VOCAB:  # the premise: some slot's k-th value is tied, so more than k tokens stay
        assert ((scores >= kth).sum(dim=-1) > top_k).any()
