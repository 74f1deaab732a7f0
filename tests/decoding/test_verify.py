"""Lossless mode (`mars_verify=True`): drafts from the masks, verified by the model itself; output = greedy AR."""

from __future__ import annotations

import collections

import pytest
import torch
from helpers import Recorder, make_model, make_tokenizer, toy_prompts
from transformers import GenerationMixin

import hf_mars
from hf_mars.decoding.settings import TREE_KEYS


def tokens_per_forward(stats):
    return stats.new_tokens.sum().item() / stats.passes_per_row.sum().item()


def test_lossless_equals_greedy_generate_at_every_tau_on_a_trained_model(trained_toy):
    model, tok = trained_toy
    enc = toy_prompts(tok)
    reference = GenerationMixin.generate(model, **enc, do_sample=False, max_new_tokens=60)
    speed = {}
    for tau in (1.0, 0.9, 0.7, 0.0):
        for candidates, lookup in ((1, 0), (3, 0), (3, 4), ((3, 3, 3), 0), ((1, 3), 4), ((2, 2, 2), 0)):
            out = model.generate(
                **enc,
                mars_tau=tau,
                mars_verify=True,
                mars_draft_candidates=candidates,
                mars_lookup=lookup,
                max_new_tokens=60,
                return_dict_in_generate=True,
            )
            assert torch.equal(out.sequences, reference), f"tau={tau}, candidates={candidates}, lookup={lookup}"
            assert out.mars_stats.forward_passes > 1
            speed[tau, candidates, lookup] = tokens_per_forward(out.mars_stats)
    assert speed[1.0, 1, 0] == speed[1.0, 3, 0] == 1.0
    assert speed[0.7, 1, 0] > 1.15 and speed[0.0, 1, 0] > 1.15  # drafts get accepted: more than one token per pass
    assert speed[0.0, 3, 0] > speed[0.0, 1, 0]  # runner-up candidates for the first draft are accepted too
    assert speed[0.0, (3, 3, 3), 0] > speed[0.0, 3, 0]  # and runner-ups at every depth
    # τ-mode at the same τ accepts more, but its output may differ from AR; lossless mode never does
    fast = model.generate(**enc, mars_tau=0.0, max_new_tokens=60, return_dict_in_generate=True)
    assert tokens_per_forward(fast.mars_stats) > speed[0.0, 1, 0]


def test_lossless_defaults_come_from_the_generation_config_preset(trained_toy):
    model, tok = trained_toy
    enc = toy_prompts(tok, n=4, seed=99)
    reference = GenerationMixin.generate(model, **enc, do_sample=False, max_new_tokens=40)
    # No τ anywhere: lossless mode runs at τ = 0 (its text does not depend on τ); before, this was plain generate()
    out = model.generate(**enc, mars_verify=True, max_new_tokens=40, return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference)
    assert set(out.mars_stats.tau_per_step) == {0.0} and max(out.mars_stats.masks_per_step) == 3  # the model's B = 4
    preset = dict(mars_tau=0.5, mars_block_size=2, mars_draft_candidates=3, mars_lookup=4)
    model.generation_config.mars_lossless = preset
    try:
        settings = hf_mars.mars_settings(model, mars_verify=True)
        assert {k: settings[k] for k in preset} == preset
        out = model.generate(**enc, mars_verify=True, max_new_tokens=40, return_dict_in_generate=True)
        assert torch.equal(out.sequences, reference)
        assert set(out.mars_stats.tau_per_step) == {0.5} and max(out.mars_stats.masks_per_step) == 1  # B = 2
        # Explicit arguments win; τ-mode ignores the preset
        assert hf_mars.mars_settings(model, mars_verify=True, mars_lookup=0, mars_tau=0.9)["mars_lookup"] == 0
        tau_mode = hf_mars.mars_settings(model, mars_tau=0.9)
        assert (tau_mode["mars_block_size"], tau_mode["mars_lookup"], tau_mode["mars_draft_candidates"]) == (4, 0, 1)
        assert hf_mars.mars_settings(model) is None  # no τ, no lossless mode: plain generate()
        # By batch size: a batch takes the entry of the largest size it reaches, else the smallest
        model.generation_config.mars_lossless = {"2": preset, "4": dict(mars_block_size=3)}
        blocks = [hf_mars.mars_settings(model, None, n, mars_verify=True)["mars_block_size"] for n in (1, 2, 3, 4, 8)]
        assert blocks == [2, 2, 2, 3, 3]
        out = model.generate(**enc, mars_verify=True, max_new_tokens=40, return_dict_in_generate=True)  # 4 rows
        assert torch.equal(out.sequences, reference) and max(out.mars_stats.masks_per_step) == 2  # B = 3
        assert model.mars_settings(batch_size=4, mars_verify=True)["mars_block_size"] == 3  # also a method
        for bad, words in (
            ({"mars_lookahead": 2}, "mars_lossless"),
            ({"mars_lookup": -1}, "mars_lookup"),
            ({"1": {"mars_lookahead": 2}}, "by batch size"),
        ):
            model.generation_config.mars_lossless = bad
            with pytest.raises(ValueError, match=words):
                model.generate(**enc, mars_verify=True, max_new_tokens=4)
    finally:
        del model.generation_config.mars_lossless


def test_mars_lossless_as_a_keyword_is_the_call_config_s_and_may_name_a_tree(trained_toy):
    """`generate()` reads a config's keys as keywords: `mars_lossless` passed so is the call's preset (transformers
    would take it into its own copy of the config, after MARS has read its settings), a tree by its name."""
    model, tok = trained_toy
    enc = toy_prompts(tok, n=4, seed=98)
    reference = GenerationMixin.generate(model, **enc, do_sample=False, max_new_tokens=40)
    assert getattr(model.generation_config, "mars_lossless", None) is None  # no base config key to absorb it

    def tree(**kwargs):
        settings = model.mars_settings(mars_verify=True, **kwargs)
        return tuple(settings[key] for key in TREE_KEYS)

    assert tree(mars_lossless="2x3+4") == (2, 3, 4) and tree(mars_lossless="3x2") == (3, 2, 0)
    out = model.generate(
        **enc, mars_verify=True, mars_lossless="2x3+4", max_new_tokens=40, return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, reference) and max(out.mars_stats.masks_per_step) == 1  # B = 2
    model.generation_config.mars_lossless = dict(mars_block_size=2)
    try:
        assert tree(mars_lossless="3x1") == (3, 1, 0)  # the keyword beats the model's preset
        assert tree(mars_lossless="3x1", mars_block_size=2) == (2, 1, 0)  # and a tree key beats the keyword's preset
        assert tree() == (2, 1, 0)
        by_batch = {"1": "2x1", "4": dict(mars_block_size=3)}
        assert model.mars_settings(None, 4, mars_verify=True, mars_lossless=by_batch)["mars_block_size"] == 3
        assert tree(mars_lossless=by_batch) == (2, 1, 0)
    finally:
        del model.generation_config.mars_lossless
    with pytest.raises(ValueError, match="draft tree"):
        model.generate(**enc, mars_verify=True, mars_lossless="2y3", max_new_tokens=4)
    with pytest.raises(ValueError, match="mars_lookahead"):
        model.mars_settings(mars_verify=True, mars_lookahead=2)


@pytest.mark.parametrize(
    "mask_cost,candidates,lookup",
    [(0.0, 1, 0), (0.2, 1, 0), (0.0, 3, 0), (0.0, 3, 4), (0.0, [2, 3], 0), (0.2, [3, 2, 2], 3), (0.0, [1, 1, 4], 2)],
)
def test_lossless_rows_alone_equal_the_batch(trained_toy, mask_cost, candidates, lookup):
    model, tok = trained_toy
    enc = toy_prompts(tok, n=4, seed=77)
    kwargs = dict(
        mars_tau=0.2,
        mars_verify=True,
        mars_draft_candidates=candidates,
        mars_lookup=lookup,
        mars_mask_cost=mask_cost,
        max_new_tokens=50,
    )
    batched = model.generate(**enc, **kwargs)
    assert torch.equal(batched, GenerationMixin.generate(model, **enc, do_sample=False, max_new_tokens=50))
    for i in range(4):
        ids = enc.input_ids[i : i + 1, enc.attention_mask[i].bool()]
        alone = model.generate(input_ids=ids, **kwargs)[0, ids.shape[1] :]
        row = batched[i, enc.input_ids.shape[1] :][: alone.shape[0]]
        assert torch.equal(row, alone)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_lossless_is_exact_even_when_drafts_are_wrong(family):
    """An untrained model's drafts are mostly wrong: every rejection path must still give the AR tokens."""
    tok = make_tokenizer()
    base = make_model(family, dtype=torch.float64)
    with torch.no_grad():
        base.lm_head.weight.mul_(4.0)
    mars = make_model(family, dtype=torch.float64)
    mars.load_state_dict(base.state_dict())
    hf_mars.to_mars(mars, tok, block_size=5)
    enc = tok(["hello world, how", "a", "the quick brown fox jumps"], return_tensors="pt", padding=True)
    for kwargs in (dict(), dict(repetition_penalty=1.3)):
        reference = base.generate(**enc, do_sample=False, max_new_tokens=30, **kwargs)
        for tau in (0.9, 0.3, 0.0):
            for cost, candidates, lookup in (
                (0.0, 1, 0),
                (0.3, 1, 0),
                (0.0, 4, 0),
                (0.0, 2, 5),
                (0.0, [2, 2, 3, 2], 0),
                (0.3, [3, 2], 0),
                (0.0, [1, 3], 5),
            ):
                out = mars.generate(
                    **enc,
                    mars_tau=tau,
                    mars_verify=True,
                    mars_mask_cost=cost,
                    max_new_tokens=30,
                    mars_draft_candidates=candidates,
                    mars_lookup=lookup,
                    **kwargs,
                )
                assert torch.equal(out, reference), (tau, cost, candidates, lookup, kwargs)


def test_a_lossless_pass_scores_every_slot_at_once_each_mask_after_its_nodes_path():
    """With a processor that reads which tokens the history holds (a repetition penalty), lossless mode scores a
    pass's every slot in one application (`scoring.scored_at_once`): each node after the history and the drafts on
    its path, as verification needs, and each mask after its node's path, not after the drafts chosen at the masks
    before it one mask at a time (as τ-mode's tokens are chosen): drafts are proposals, verification keeps the output
    exact."""
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    from hf_mars.decoding.scoring import Histories, scored_at_once
    from hf_mars.decoding.tree import DraftTree
    from hf_mars.decoding.verify import propose

    tree, masks = DraftTree.of((-1,)), 2  # one draft after the root; two masks after each node
    logits = torch.zeros(1, 2 + 2 * masks, 8)
    logits[..., 5], logits[..., 6] = 9.0, 8.0  # every slot's top token is 5, not in the history
    penalty = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(100.0)])
    history = Histories(penalty, torch.tensor([[1, 2, 0]]), None, torch.tensor([2]))
    drafts = torch.tensor([[5]])
    scores = scored_at_once(logits, history, drafts, tree.scored_lineage(masks, "cpu"))
    # root, the draft (after 5), the root's masks, the draft's masks (after 5)
    assert scores.argmax(dim=-1)[0].tolist() == [5, 6, 5, 5, 6, 6]
    after_draft = Histories(penalty, torch.tensor([[1, 2, 5]]), None, torch.tensor([3]))
    in_order = propose(logits[:, 4:], after_draft, 0.0, None, "probability", False, 1, 0)
    assert in_order.tokens[0].tolist() == [6, 5]  # premise: in order, the mask before penalises 6 at the next
    at_once = propose(scores[:, 4:], None, 0.0, None, "probability", False, 1, 0)
    assert at_once.tokens[0].tolist() == [6, 6] and at_once.real.all()


def test_prompt_lookup_finds_what_followed_the_latest_longest_match():
    from hf_mars.decoding.tree import lookup as _lookup

    pad = 0
    sequences = torch.tensor(
        [
            [pad, 1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3, pad, pad],  # "2 3" last followed by 7 8 5 (latest match)
            [1, 2, 3, 4, 5, 6, 7, 8, 9, 4, 5, 6, 7, 4, 5],  # 3-gram "7 4 5" is new; "4 5" last came before 6 7 4
            [5, 6, 7, 8, 6, 7, pad, pad, pad, pad, pad, pad, pad, pad, pad],  # "6 7" at the end of the text: 8 6 7
            [1, 2, 3, 4, pad, pad, pad, pad, pad, pad, pad, pad, pad, pad, pad],  # nothing repeats
        ]
    )
    lengths = torch.tensor([13, 15, 6, 4])
    found, real = _lookup(sequences, lengths, 4)
    assert found[0, :3].tolist() == [7, 8, 5] and real[0].tolist() == [True] * 4  # then "2" (reaches the last token)
    assert found[1, :3].tolist() == [6, 7, 4] and real[1].all()
    assert found[2, :3].tolist() == [8, 6, 7] and real[2].tolist() == [True, True, True, False]  # the text ends
    assert not real[3].any()


def _lookup_by_hand(row: list[int], length: int, num_tokens: int, longest: int = 3):
    """Prompt lookup as its docstring says it, one row in Python: `(found, real)` where something matched."""
    text = row[:length]
    for n in range(min(longest, length), 0, -1):
        starts = [s for s in range(length - n) if text[s : s + n] == text[length - n :]]  # ends before the last
        if starts:
            index = [starts[-1] + n + i for i in range(num_tokens)]
            return [row[min(i, len(row) - 1)] for i in index], [i < length for i in index]
    return None, [False] * num_tokens


def test_prompt_lookup_of_every_ngram_length_at_once_is_the_rule_row_by_row():
    """`tree.lookup` matches all n-gram lengths in one pass of fixed ops; on random texts of a small vocabulary (many
    repeats, rows shorter than the longest n-gram too) it finds what the rule, applied row by row, finds."""
    from hf_mars.decoding.tree import lookup as _lookup

    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        draw = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=generator))  # noqa: E731
        rows, width, vocab, num_tokens = draw(1, 5), draw(1, 12), draw(2, 5), draw(1, 6)
        sequences = torch.randint(0, vocab, (rows, width), generator=generator)
        lengths = torch.randint(1, width + 1, (rows,), generator=generator)
        found, real = _lookup(sequences, lengths, num_tokens)
        for row in range(rows):
            tokens, expected = _lookup_by_hand(sequences[row].tolist(), int(lengths[row]), num_tokens)
            assert real[row].tolist() == expected
            if tokens is not None:
                kept = [t for t, r in zip(tokens, expected) if r]
                assert [t for t, r in zip(found[row].tolist(), expected) if r] == kept


def test_lossless_with_prompt_lookup_accepts_repeated_text_exactly():
    """Text that repeats is what lookup drafts: at τ = 1 (no masks, no mask drafts) they alone give more than one
    token per pass, with the output still exactly greedy `generate()`'s. The model here repeats its last token: its
    layers add nothing to the residual stream and its output head is its embedding."""
    tok = make_tokenizer()
    model = make_model("llama", dtype=torch.float64)
    hf_mars.to_mars(model, tok, block_size=3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    enc = tok(["one two three one two three one two", "abc abc abc"], return_tensors="pt", padding=True)
    reference = GenerationMixin.generate(model, **enc, do_sample=False, max_new_tokens=40)
    out = model.generate(
        **enc, mars_tau=1.0, mars_verify=True, mars_lookup=4, max_new_tokens=40, return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, reference)
    assert tokens_per_forward(out.mars_stats) > 1.5


def test_verification_keeps_the_deepest_path_when_sibling_drafts_are_equal():
    """A lookup draft may equal a mask's: both siblings match, and the path through the one with a matching child
    must be kept (its tokens, and its end, whose group of masks proposes the next drafts)."""
    from hf_mars.decoding.tree import DraftTree
    from hf_mars.decoding.verify import Drafts, verify

    vocab, parents = 10, (-1, -1, 1)  # drafts 0 and 1 both follow the root; draft 2 follows draft 1
    drafts = torch.tensor([[4, 4, 6], [4, 4, 6]])
    draft_real = torch.tensor([[True, True, True], [True, True, False]])
    targets = torch.tensor([[4, 6, 6, 2], [4, 6, 6, 2]])  # argmax at the root, then at drafts 0, 1 (equal), 2
    logits = torch.nn.functional.one_hot(targets, vocab).float()
    tokens, accepted, kept, end = verify(logits, Drafts(drafts, draft_real, DraftTree.of(parents)), None, False)
    assert accepted.tolist() == [3, 2]
    assert tokens[0, :3].tolist() == [4, 6, 2] and tokens[1, :2].tolist() == [4, 6]
    assert end[0] == 3 and kept[0].tolist() == [False, True, True]
    assert end[1] in (1, 2) and kept[1].sum() == 1 and not kept[1, 2]  # either equal sibling, alone


@pytest.mark.parametrize("drafts", [0, 1, 4])
def test_a_chain_keeps_the_node_a_tree_would_keep(drafts):
    """A chain's deepest kept node is its count of leading matches (`TreeTensors.chain`): the node the tree's own rule
    (every draft on its path matches; the deepest) finds, for every pattern of matches."""
    from hf_mars.decoding.tree import DraftTree
    from hf_mars.decoding.verify import deepest_kept

    tree = DraftTree.of(tuple(range(-1, drafts - 1))).on("cpu")
    assert tree.chain
    bits = torch.arange(2**drafts)[:, None] >> torch.arange(drafts) & 1  # every pattern, one a row
    match = bits.bool()
    chain_taken, chain_end, chain_kept = deepest_kept(match, tree)
    taken, end, kept = deepest_kept(match, tree._replace(chain=False))
    assert torch.equal(chain_kept, kept)
    assert torch.equal(chain_taken, taken) and torch.equal(chain_end, end)
    assert set((taken - 1).tolist()) == set(range(drafts + 1)), "every depth must be some pattern's"


@pytest.mark.parametrize("family,attention", [("qwen2", "sdpa"), ("llama", "eager"), ("qwen3", "sdpa")])
def test_a_lossless_pass_computes_what_plain_passes_over_each_branch_compute(family, attention):
    """A lossless pass feeds [pending | drafts as a tree | one group of masks after the root and after each draft].
    Each draft, and each group, must compute exactly what a plain causal pass over the text it continues computes,
    in every row (a row with a missing draft and a left-padded row included)."""
    from hf_mars.decoding.cache import StaticMARSCache
    from hf_mars.decoding.runner import rows_cache
    from hf_mars.decoding.tree import DraftTree, tree_attention

    # float32 for eager: in float64 its padding mask overflows to -inf in its float32 softmax (NaN, transformers 5.23)
    model = make_model(family, dtype=torch.float64 if attention == "sdpa" else torch.float32)
    model.set_attn_implementation(attention)
    mask_id, masks = 260, 2
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    real = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    cache = StaticMARSCache(rows_cache(model, 2, 32), 2, "cpu")  # a runner's
    with torch.no_grad():
        mask_2d, positions = cache.step_inputs(real, 0)
        model(input_ids=ids, attention_mask=mask_2d, position_ids=positions, **cache.forward_kwargs(width))
        cache.commit(real, 0)
        pending = torch.tensor([[20], [21]])
        parents = [-1, 0, 1, -1]  # a chain of three, and a sibling of its first draft
        drafts = torch.tensor([[30, 31, 32, 35], [40, 41, 0, 45]])
        draft_real = torch.tensor([[True, True, True, True], [True, True, False, True]])
        new_real = torch.cat([torch.ones_like(pending, dtype=torch.bool), draft_real], dim=1)
        tree = DraftTree.of(tuple(parents))
        mask_2d, positions = cache.step_inputs(new_real, masks, tree)
        mask_4d = tree_attention(model, cache, tree, mask_2d, 1, masks)
        fed = torch.cat([pending, drafts, torch.full((2, (len(parents) + 1) * masks), mask_id)], dim=1)
        logits = model(
            input_ids=fed, attention_mask=mask_4d, position_ids=positions, **cache.forward_kwargs(fed.shape[1])
        )
        logits = logits.logits
    lineage = {-1: []}
    for i, parent in enumerate(parents):
        lineage[i] = lineage[parent] + [i]
    for row, prompt in enumerate(prompts):
        for node in [-1] + [i for i in range(len(parents)) if draft_real[row, i]]:
            text = prompt + pending[row].tolist() + drafts[row, lineage[node]].tolist()
            with torch.no_grad():
                plain = model(input_ids=torch.tensor([text + [mask_id] * masks])).logits[0]
            group = logits[row, 1 + len(parents) + (node + 1) * masks :][:masks]
            assert torch.allclose(group, plain[-masks:], rtol=0, atol=1e-5), (row, node)
            assert torch.allclose(logits[row, node + 1], plain[len(text) - 1], rtol=0, atol=1e-5), (row, node)


def test_lossless_streams_each_pass(trained_toy):

    model, tok = trained_toy
    enc = toy_prompts(tok, n=1)
    streamer = Recorder()
    out = model.generate(
        **enc, mars_tau=0.0, mars_verify=True, max_new_tokens=40, streamer=streamer, return_dict_in_generate=True
    )
    _, *chunks = streamer.chunks
    assert [len(c) for c in chunks] == [int(a) for a in out.mars_stats.accepted_per_step]
    assert sum(chunks, []) == out.sequences[0, enc.input_ids.shape[1] :].tolist()


# --- sampling: speculative acceptance keeps the model's own distribution ------------------------------------------


def first_tokens(sequences, start, n=3):
    return collections.Counter(map(tuple, sequences[:, start : start + n].tolist()))


def total_variation(a, b, n):
    return 0.5 * sum(abs(a[k] - b[k]) / n for k in set(a) | set(b))


def plain_samples(model, ids, seed):
    """3-token samples of transformers' own `generate()`, one per row of `ids`."""
    torch.manual_seed(seed)
    out = GenerationMixin.generate(model, input_ids=ids, do_sample=True, max_new_tokens=3, eos_token_id=None)
    return first_tokens(out, ids.shape[1])


def mars_samples(model, ids, seed, **kwargs):
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=ids, do_sample=True, max_new_tokens=3, eos_token_id=None, return_dict_in_generate=True, **kwargs
    )
    return first_tokens(out.sequences, ids.shape[1]), out.mars_stats


def check_distribution(model, ids, accepted_more_than):
    """Lossless sampling is as close to `generate()`'s samples as two runs of `generate()` are to each other."""
    n = ids.shape[0]
    reference, again = plain_samples(model, ids, 0), plain_samples(model, ids, 1)
    lossless, stats = mars_samples(model, ids, 2, mars_tau=0.0, mars_verify=True)
    noise = total_variation(reference, again, n)
    assert total_variation(lossless, reference, n) < noise + 0.03
    assert stats.mean_tokens_per_forward > accepted_more_than
    return reference, noise


def test_lossless_sampling_keeps_the_distribution_when_drafts_are_rejected():
    tok = make_tokenizer()
    model = hf_mars.to_mars(make_model("qwen2"), tok, block_size=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.5)
    ids = tok(["the quick"], return_tensors="pt").input_ids.repeat(3000, 1)
    reference, noise = check_distribution(model, ids, accepted_more_than=1.0)
    # The check can fail: τ-mode at τ = 0 keeps every mask sample as it is, and its samples are far off.
    fast, _ = mars_samples(model, ids, 3, mars_tau=0.0)
    assert total_variation(fast, reference, 3000) > noise + 0.3


def test_lossless_sampling_keeps_the_distribution_when_drafts_are_accepted(trained_toy):
    model, tok = trained_toy
    messages = [{"role": "user", "content": "Count from 12 to 30."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    check_distribution(model, ids.repeat(2000, 1), accepted_more_than=1.2)


def test_lossless_sampling_anchors():
    tok = make_tokenizer()
    base = make_model("qwen2")
    model = make_model("qwen2")
    model.load_state_dict(base.state_dict())
    hf_mars.to_mars(model, tok, block_size=4)
    enc = tok(["hello"], return_tensors="pt")
    torch.manual_seed(5)
    reference = base.generate(**enc, do_sample=True, top_k=30, max_new_tokens=15)
    torch.manual_seed(5)  # τ = 1 proposes nothing: plain sampling, draw for draw
    assert torch.equal(
        model.generate(**enc, do_sample=True, top_k=30, mars_tau=1.0, mars_verify=True, max_new_tokens=15), reference
    )
    greedy = model.generate(**enc, mars_tau=0.3, mars_verify=True, max_new_tokens=15)  # top_k = 1 sampling is greedy
    assert torch.equal(
        model.generate(**enc, do_sample=True, top_k=1, mars_tau=0.3, mars_verify=True, max_new_tokens=15), greedy
    )
