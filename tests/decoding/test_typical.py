"""Typical acceptance (`mars_accept="typical"`): lossless mode's tree, drafts kept where the verifying distribution
finds them plausible (Medusa's rule), at greedy and with sampling."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import make_model, make_tokenizer, toy_prompts
from transformers import GenerationMixin

import hf_mars
from hf_mars.decoding.tree import DraftTree
from hf_mars.decoding.verify import Drafts, verify

VOCAB = 12


def logits_of(*slots):
    """`(1, slots, VOCAB)` logits whose softmax is each slot's {token: probability}, the rest shared evenly."""
    rows = []
    for probs in slots:
        rest = (1.0 - sum(probs.values())) / (VOCAB - len(probs))
        p = torch.full((VOCAB,), rest)
        for token, value in probs.items():
            p[token] = value
        rows.append(p.log())
    return torch.stack(rows)[None]


def chain(*tokens) -> Drafts:
    ids = torch.tensor([tokens])
    return Drafts(ids, torch.ones_like(ids, dtype=torch.bool), DraftTree.of(tuple(range(-1, len(tokens) - 1))))


def bar(probs, epsilon=0.09, delta=0.3):
    """min(ε, δ·exp(-H)) of a slot built by `logits_of`."""
    p = torch.softmax(logits_of(probs)[0, 0], dim=-1)
    return min(epsilon, delta * math.exp(-float(torch.special.entr(p).sum())))


def test_a_plausible_draft_is_kept_where_exact_verification_rejects_it():
    root, after_first = {1: 0.55, 2: 0.40}, {6: 0.9, 5: 0.05}
    logits = logits_of(root, after_first, {7: 0.99})
    assert bar(root) < 0.40 and bar(after_first) > 0.05  # the hand-built case is the one meant
    tokens, accepted, kept, end = verify(logits, chain(2, 5), None, do_sample=False, typical=(0.09, 0.3))
    # Draft 2 (p = 0.40, not the argmax) is kept, draft 5 (p = 0.05 where p is peaked) is not: the argmax 6 follows
    assert tokens[0, : accepted[0]].tolist() == [2, 6] and kept.tolist() == [[True, False]] and end.tolist() == [1]
    tokens, accepted, kept, _ = verify(logits, chain(2, 5), None, do_sample=False)
    assert tokens[0, : accepted[0]].tolist() == [1] and not kept.any()  # exact: the model's own argmax


def test_the_bar_falls_where_the_distribution_is_spread_out():
    peaked = {1: 0.9, 3: 0.05}
    spread = {1: 0.12, 3: 0.05, **{t: 0.09 for t in range(4, 12)}}  # H near log 11: δ·exp(-H) near 0.03
    assert bar(spread) < 0.05 < bar(peaked)
    for probs, keeps in ((peaked, False), (spread, True)):
        tokens, accepted, kept, _ = verify(logits_of(probs, {8: 0.99}), chain(3), None, False, typical=(0.09, 0.3))
        assert kept.tolist() == [[keeps]]
        assert tokens[0, : accepted[0]].tolist() == ([3, 8] if keeps else [1])
    # ε caps the bar: with ε = 0.04 the draft at 0.05 passes even where p is peaked
    _, _, kept, _ = verify(logits_of(peaked, {8: 0.99}), chain(3), None, False, typical=(0.04, 0.3))
    assert kept.tolist() == [[True]]


def test_the_deepest_typical_path_of_a_tree_is_kept():
    # Root, then two siblings at depth 1 (slots 1, 2), then a child of the second (slot 3)
    drafts = Drafts(torch.tensor([[4, 2, 9]]), torch.ones(1, 3, dtype=torch.bool), DraftTree.of((-1, -1, 1)))
    logits = logits_of({1: 0.5, 2: 0.3, 4: 0.15}, {5: 0.99}, {9: 0.6, 10: 0.3}, {11: 0.99})
    tokens, accepted, kept, end = verify(logits, drafts, None, False, typical=(0.09, 0.3))
    assert tokens[0, : accepted[0]].tolist() == [2, 9, 11]  # both siblings pass; the one with a child goes deeper
    assert kept.tolist() == [[False, True, True]] and end.tolist() == [3]


def test_with_sampling_the_token_after_the_kept_drafts_is_drawn_from_the_verifying_distribution():
    torch.manual_seed(0)
    rows = 4000
    logits = logits_of({1: 0.5, 2: 0.45}, {3: 0.7, 4: 0.3}).expand(rows, -1, -1)
    drafts = Drafts(torch.full((rows, 1), 2), torch.ones(rows, 1, dtype=torch.bool), DraftTree.of((-1,)))
    tokens, accepted, kept, _ = verify(logits, drafts, None, do_sample=True, typical=(0.09, 0.3))
    assert kept.all() and (accepted == 2).all() and (tokens[:, 0] == 2).all()
    share = (tokens[:, 1] == 3).float().mean().item()
    assert abs(share - 0.7) < 0.03 and set(tokens[:, 1].tolist()) <= set(range(VOCAB))


TREES = [(1, 0), ((3, 2), 0), (3, 4)]


@pytest.mark.parametrize("candidates, lookup", TREES)
def test_a_bar_above_one_half_keeps_only_argmax_drafts_so_typical_is_then_exact(trained_toy, candidates, lookup):
    model, tok = trained_toy
    enc = toy_prompts(tok, n=4, seed=31)
    reference = GenerationMixin.generate(model, **enc, do_sample=False, max_new_tokens=50)
    kwargs = dict(mars_verify=True, mars_draft_candidates=candidates, mars_lookup=lookup, max_new_tokens=50)
    out = model.generate(
        **enc,
        mars_accept="typical",
        mars_typical_epsilon=0.6,
        mars_typical_delta=1e6,
        return_dict_in_generate=True,
        **kwargs,
    )
    assert torch.equal(out.sequences, reference)
    assert out.mars_stats.mean_tokens_per_forward > 1.2  # drafts were kept, not merely offered


@pytest.mark.parametrize("candidates, lookup", TREES)
def test_typical_rows_alone_equal_the_batch_and_keep_at_least_the_exact_drafts(trained_toy, candidates, lookup):
    model, tok = trained_toy
    enc = toy_prompts(tok, n=4, seed=32)
    kwargs = dict(mars_verify=True, mars_draft_candidates=candidates, mars_lookup=lookup, max_new_tokens=50)
    typical = model.generate(**enc, mars_accept="typical", return_dict_in_generate=True, **kwargs)
    exact = model.generate(**enc, return_dict_in_generate=True, **kwargs)
    assert typical.mars_stats.mean_tokens_per_forward >= exact.mars_stats.mean_tokens_per_forward - 0.05
    for i in range(4):
        ids = enc.input_ids[i : i + 1, enc.attention_mask[i].bool()]
        alone = model.generate(input_ids=ids, mars_accept="typical", **kwargs)[0, ids.shape[1] :]
        assert torch.equal(typical.sequences[i, enc.input_ids.shape[1] :][: alone.shape[0]], alone)
    static = model.generate(**enc, mars_accept="typical", cache_implementation="static", **kwargs)
    assert torch.equal(static, typical.sequences)


def test_typical_sampling_verifies_the_greedy_tree_and_is_seeded(trained_toy):
    model, tok = trained_toy
    enc = toy_prompts(tok, n=2, seed=33)
    kwargs = dict(mars_verify=True, mars_accept="typical", mars_draft_candidates=3, mars_lookup=4, max_new_tokens=40)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(model.generate(**enc, do_sample=True, temperature=0.7, return_dict_in_generate=True, **kwargs))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].mars_stats.mean_tokens_per_forward > 1.2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(mars_accept="typical", mars_tau=0.9), "needs mars_verify=True"),
        (dict(mars_verify=True, mars_accept="medusa"), "mars_accept must be one of"),
        (dict(mars_verify=True, mars_typical_epsilon=0.1), 'needs mars_accept="typical"'),
        (dict(mars_verify=True, mars_accept="typical", mars_typical_epsilon=0.0), r"\(0, 1\]"),
        (dict(mars_verify=True, mars_accept="typical", mars_typical_epsilon=1.5), r"\(0, 1\]"),
        (dict(mars_verify=True, mars_accept="typical", mars_typical_delta=-1.0), "mars_typical_delta must be"),
        (dict(mars_verify=True, mars_accept="typical", mars_typical_delta="0.3"), "mars_typical_delta must be"),
        (dict(mars_accept="typical"), "has no effect without mars_tau or mars_verify"),
    ],
)
def test_typical_settings_are_checked_with_the_argument_named(kwargs, message):
    tok = make_tokenizer()
    model = hf_mars.to_mars(make_model("qwen2"), tok, block_size=4)
    enc = tok(["hello"], return_tensors="pt")
    with pytest.raises(ValueError, match=message):
        model.generate(**enc, max_new_tokens=3, **kwargs)


def test_typical_acceptance_is_read_from_a_generation_config(trained_toy):
    model, tok = trained_toy
    enc = toy_prompts(tok, n=2, seed=34)
    config = model.generation_config.__class__.from_dict(
        model.generation_config.to_dict(), mars_verify=True, mars_accept="typical", mars_typical_epsilon=0.2
    )
    settings = model.mars_settings(config)
    assert settings["mars_accept"] == "typical" and settings["mars_typical_epsilon"] == 0.2
    by_config = model.generate(**enc, generation_config=config, max_new_tokens=30)
    by_keywords = model.generate(
        **enc, mars_verify=True, mars_accept="typical", mars_typical_epsilon=0.2, max_new_tokens=30
    )
    assert torch.equal(by_config, by_keywords)
