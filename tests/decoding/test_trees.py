"""Per-depth draft trees (`mars_draft_candidates=[4, 3, 2]`): their shape, their names, and how `hf-mars tune`
measures per-depth accuracy and proposes trees from it."""

from __future__ import annotations

import pytest
import torch
from helpers import make_model, make_tokenizer
from transformers import GenerationConfig, GenerationMixin

import hf_mars
from hf_mars.decoding.costs import check_acceptance, parse_tree, pass_width, tree_key
from hf_mars.decoding.settings import MARSSettings
from hf_mars.decoding.verify import propose
from hf_mars.tools.measure.tuning import best_counts, chain_accuracy, depth_accuracy, propose_trees, ranks_along


def distributions(rows):
    """`(rows, masks, vocab)` logits whose softmax puts the given probabilities on the given tokens, the rest spread
    thinly over the other tokens."""
    vocab = 12
    probs = torch.full((len(rows), len(rows[0]), vocab), 1e-4)
    for r, row in enumerate(rows):
        for m, mask in enumerate(row):
            for token, p in mask.items():
                probs[r, m, token] = p
    return probs.log()


def test_runner_ups_of_each_depth_are_siblings_of_that_depth_s_chain_draft():
    followed = distributions(
        [
            [{1: 0.5, 2: 0.32, 3: 0.18}, {4: 0.6, 5: 0.39}, {6: 0.99}],  # a chain of three, confident runner-ups
            [{1: 0.9, 2: 0.09}, {4: 0.2, 5: 0.1, 7: 0.19, 8: 0.18, 9: 0.17, 10: 0.16}, {6: 0.99}],  # stops at depth 1
        ]
    )
    settings = MARSSettings(tau=0.3, block_size=4, mask_token_id=0, verify=True, draft_candidates=(3, 2))
    within = torch.ones(2, 3, dtype=torch.bool)
    drafts = propose(followed, None, 0.3, within, settings.confidence, False, (3, 2), -1)
    # The chain, mask 1's two runner-ups after the root, mask 2's runner-up after the chain's first draft
    assert drafts.tree.parents == (-1, 0, 1, -1, -1, 0)
    assert drafts.tree.depths.tolist() == [1, 2, 3, 1, 1, 2]
    assert drafts.tokens[0].tolist() == [1, 4, 6, 2, -1, 5]  # token 3 (0.18) is below τ
    assert drafts.real[0].tolist() == [True, True, True, True, False, True]
    assert drafts.real[1].tolist() == [True, False, False, False, False, False]  # nothing past the chain's end
    # An int N is [N]: runner-ups for the first draft only, today's trees
    drafts = propose(followed, None, 0.0, within, settings.confidence, False, 3, -1)
    assert drafts.tree.parents == (-1, 0, 1, -1, -1)
    per_depth = propose(followed, None, 0.0, within, settings.confidence, False, (3, 1, 1), -1)
    assert per_depth.tree == drafts.tree


def test_per_depth_candidates_are_validated_with_the_argument_named():
    tok = make_tokenizer()
    model = hf_mars.to_mars(make_model("qwen2"), tok, block_size=4)
    enc = tok(["hello"], return_tensors="pt")
    for bad in ([2, 2, 2, 2], [], [0, 2], [2, True], [2.0], "3", (2, -1)):
        with pytest.raises(ValueError, match="mars_draft_candidates must be"):
            model.generate(**enc, mars_verify=True, mars_draft_candidates=bad, max_new_tokens=3)
    with pytest.raises(ValueError, match="at most B-1 = 1 long"):  # B = 2 has one depth of drafts
        model.generate(**enc, mars_verify=True, mars_block_size=2, mars_draft_candidates=[2, 2], max_new_tokens=3)
    with pytest.raises(ValueError, match="mars_draft_candidates shapes lossless mode's draft tree"):
        model.generate(**enc, mars_tau=0.5, mars_draft_candidates=[1, 2], max_new_tokens=3)
    # Runner-ups nowhere is the chain, which τ-mode's settings may name
    assert model.mars_settings(mars_tau=0.5, mars_draft_candidates=[1, 1])["mars_draft_candidates"] == [1, 1]
    settings = model.mars_settings(mars_verify=True, mars_draft_candidates=(4, 3, 2))  # a list, as JSON holds it
    assert settings["mars_draft_candidates"] == [4, 3, 2]


def test_per_depth_candidates_come_from_the_generation_config_too():
    tok = make_tokenizer()
    base = make_model("llama", dtype=torch.float64)
    model = make_model("llama", dtype=torch.float64)
    model.load_state_dict(base.state_dict())
    hf_mars.to_mars(model, tok, block_size=4)
    enc = tok(["hello world, how", "the quick"], return_tensors="pt", padding=True)
    reference = base.generate(**enc, do_sample=False, max_new_tokens=20)
    model.generation_config.mars_lossless = dict(mars_draft_candidates=[3, 2, 2], mars_lookup=2)
    try:
        assert model.mars_settings(mars_verify=True)["mars_draft_candidates"] == [3, 2, 2]
        assert torch.equal(model.generate(**enc, mars_verify=True, max_new_tokens=20), reference)
    finally:
        del model.generation_config.mars_lossless
    config = GenerationConfig(mars_verify=True, mars_draft_candidates=[2, 3], max_new_tokens=20)  # the call's config
    assert model.mars_settings(config)["mars_draft_candidates"] == [2, 3]
    assert torch.equal(model.generate(**enc, generation_config=config), reference)


def test_tree_names_cover_per_depth_candidates():
    assert parse_tree("4x3,2,2+4") == (4, (3, 2, 2), 4)
    assert parse_tree("4x1,3") == (4, (1, 3), 0)
    # Trailing ones are the chain anyway: one tree, one name, as an int where only depth 1 has runner-ups
    assert parse_tree("4x3,1,1") == parse_tree("4x3") == (4, 3, 0)
    assert tree_key(4, [3, 2, 1], 0) == "4x3,2" and tree_key(4, (3,), 2) == "4x3+2"
    for name in ("2x1", "2x3+4", "4x3,2+8", "4x1,1,5", "3x2,2"):
        assert tree_key(*parse_tree(name)) == name
    # The chain's B-1 drafts, plus every runner-up, plus lookup; an int N adds N-1
    assert pass_width(4, (3, 2, 2), 4) == (1 + 3 + (2 + 1 + 1) + 4) * 4
    assert pass_width(4, 3, 0) == pass_width(*parse_tree("4x3,1,1"))
    for bad in ("2x3,2", "4x3,0", "4x1,1,1,1", "4x3,", "4x,3"):
        with pytest.raises(ValueError, match="BxN"):
            parse_tree(bad)
    assert check_acceptance({"4x3,2+4": 2.5}) == {"4x3,2+4": 2.5}
    with pytest.raises(ValueError, match="BxN"):
        check_acceptance({"2x3,2": 2.0})
    assert tree_key(4, (3, 2), 4) == "4x3,2+4" and tree_key(2, 3, 0) == "2x3"  # bench names trees so too


def test_a_checkpoint_s_acceptance_may_name_per_depth_trees_for_auto(monkeypatch):
    from hf_mars.decoding import settings as settings_module
    from hf_mars.decoding.costs import Costs

    tok = make_tokenizer()
    model = hf_mars.to_mars(make_model("qwen2"), tok, block_size=4)
    acceptance = {"2x1": 1.5, "4x3,2,2": 2.6}
    widths = {1, 4, *(pass_width(*parse_tree(name)) for name in acceptance)}
    monkeypatch.setattr(settings_module, "pass_costs", lambda *args, **kwargs: Costs({w: 0.01 for w in widths}))
    model.generation_config.mars_acceptance, model.generation_config.mars_lossless = acceptance, "auto"
    try:
        settings = model.mars_settings(mars_verify=True)  # a free wide pass: the widest tree
        assert (settings["mars_block_size"], settings["mars_draft_candidates"]) == (4, [3, 2, 2])
    finally:
        del model.generation_config.mars_acceptance, model.generation_config.mars_lossless


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_one_forward_ranks_every_position_s_masks_as_plain_passes_do(family):
    """`ranks_along` feeds the text and a group of masks after every position in one pass: each group must rank the
    text's tokens as a plain causal pass over the text up to its position, then masks, does."""
    tok = make_tokenizer()
    model = hf_mars.to_mars(make_model(family), tok, block_size=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    ids = tok(["the quick brown fox"], return_tensors="pt").input_ids
    text = GenerationMixin.generate(model, input_ids=ids, do_sample=False, max_new_tokens=12, eos_token_id=None)[0]
    top = 50
    ranks = ranks_along(model, text, ids.shape[1], top)
    start, masks, mask_id = ids.shape[1], 3, model.config.mars_mask_token_id
    assert ranks.shape == (text.shape[0] - masks - start, masks)
    for i, t in enumerate(range(start - 1, text.shape[0] - masks - 1)):
        fed = torch.cat([text[: t + 1], torch.full((masks,), mask_id)])
        with torch.no_grad():
            logits = model(input_ids=fed[None]).logits[0, -masks:]
        truth = text[t + 2 : t + 2 + masks]
        expected = (logits > logits.gather(1, truth[:, None])).sum(dim=1).clamp(max=top)
        assert ranks[i].tolist() == expected.tolist(), t
    assert ranks.min() < top  # the test compares ranks, not only "not in the top"


def test_accuracy_tables_from_ranks():
    ranks = torch.tensor([[0, 0, 0], [1, 0, 2], [0, 3, 0], [2, 2, 2]])  # rank of the true token, mask by mask
    assert depth_accuracy(ranks, top=3)[0] == [0.5, 0.75, 1.0]
    reached = chain_accuracy(ranks, top=3)
    assert reached[0] == [0.5, 0.75, 1.0]  # depth 1 is always reached
    assert reached[1] == [0.25, 0.25, 0.25]  # only rows 0 and 2 reach depth 2 (row 2's is rank 3)
    assert reached[2] == [0.25, 0.25, 0.25]  # only row 0's chain is right at depths 1 and 2


def test_proposals_put_candidates_where_they_are_accepted():
    # Mask 1's runner-ups are often right, deeper masks' rarely: candidates go to depth 1
    shallow = [[0.5, 0.7, 0.8, 0.85], [0.2, 0.22, 0.23, 0.24], [0.1, 0.11, 0.11, 0.11]]
    counts, gain = best_counts(shallow, 2)
    assert counts == (3, 1, 1) and gain == pytest.approx(0.8 + 0.2 + 0.1)
    # Runner-ups at depth 2 earn more than a third one at depth 1
    deep = [[0.5, 0.55, 0.56, 0.57], [0.3, 0.4, 0.42, 0.43], [0.2, 0.21, 0.215, 0.22]]
    assert best_counts(deep, 2)[0] == (2, 2, 1) and best_counts(deep, 3)[0] == (2, 3, 1)
    assert best_counts(deep, 12) is None  # more than the measured top 4 at every depth
    frontier = propose_trees(deep, max_width=40)
    widths = [width for width, _, _ in frontier]
    tokens = [expected for _, _, expected in frontier]
    assert widths == sorted(set(widths)) and tokens == sorted(set(tokens))  # wider passes, more tokens
    assert all(width == pass_width(*tree) <= 40 for width, tree, _ in frontier)
    assert frontier[0] == (4, (2, 1, 0), 1.5)  # one draft: mask 1's top token, right half the time
    by_tree = {tree_key(*tree): expected for _, tree, expected in frontier}
    assert by_tree["4x2,3"] == pytest.approx(1 + 0.55 + 0.42 + 0.2)  # (4 + 3) * 4 = 28 wide


def test_tune_measures_per_depth_trees_by_name(tmp_path):
    """The trees `propose_trees` names can be timed by `tune_lossless` and saved into `mars_acceptance`, and the
    fastest saved as a preset that `generate()` reads back."""
    from hf_mars.tools.evaluate.evals import load_prompts
    from hf_mars.tools.measure.tuning import acceptance, save_acceptance, save_lossless_preset, tune_lossless

    tok = make_tokenizer()
    model = hf_mars.to_mars(make_model("qwen2"), tok, block_size=4)
    prompts = load_prompts("toy", tok, limit=2)
    trees = [parse_tree("4x2,2"), parse_tree("3x1,3+2")]
    best, _, cells = tune_lossless(model, tok, prompts, trees=trees, max_new_tokens=6, progress=False)
    measured = acceptance(cells, trees)
    assert set(measured) == {"4x2,2", "3x1,3+2"} and all(tokens >= 1 for tokens in measured.values())
    assert all(cell.agreement == 1.0 for cell in cells if cell.method.startswith("lossless"))
    model.save_pretrained(tmp_path)
    save_acceptance(tmp_path, measured)
    save_lossless_preset(tmp_path, best)
    config = GenerationConfig.from_pretrained(tmp_path)
    assert config.mars_acceptance == measured
    model.generation_config = config
    candidates = model.mars_settings(mars_verify=True)["mars_draft_candidates"]
    assert candidates == best["mars_draft_candidates"]
