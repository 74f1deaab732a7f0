"""`Runner` (decoding/runner.py): a server's rows decoding in one graph pass over a static cache, joining free rows
between passes (their prompt's pass straight into the runner's cache) and freeing them the moment they stop."""

from __future__ import annotations

import pytest
import torch
from helpers import make_model, make_tokenizer, sliding_mars_model, toy_prompts
from transformers import CompileConfig, GenerationMixin

import hf_mars
from hf_mars.decoding import cache, graph, graph_state
from hf_mars.decoding.compat import CACHE_ARG
from hf_mars.decoding.runner import Runner, serving_runner
from hf_mars.decoding.tree import full_tree

MODES = {
    "tau=1": dict(mars_tau=1.0),
    "lossless tree": dict(mars_verify=True, mars_draft_candidates=2, mars_lookup=3),
    # Sampling from the top token alone is greedy decoding, drawn: the graph pass's sampling, held to exact tokens
    "sampled top-1, tau=1": dict(mars_tau=1.0, do_sample=True, top_k=1),
    "sampled top-1, lossless": dict(mars_verify=True, do_sample=True, top_k=1),
    # A processor that reads each row's tokens (from column 0 here, where `generate()`'s batch pads on the left)
    "penalised, tau=1": dict(mars_tau=1.0, repetition_penalty=1.3),
    "penalised, lossless": dict(mars_verify=True, mars_draft_candidates=2, mars_lookup=3, repetition_penalty=1.3),
}
PROCESSING = ("repetition_penalty",)  # what the reference, plain greedy generate(), is given too
# A few passes more than the longest prompt and budget need
SLOTS = {name: 160 if "lossless" in name else 96 for name in MODES}


def _opened(model, prompt, label, budget, mode):
    """A request's rows before their prompt's pass, as the engine prepares them for a runner to admit."""
    return model.mars_rows(prompt[None], labels=[label], budgets=[budget], max_new_tokens=30, **mode)


def _serve(
    model, prompts, budgets, mode, max_rows: int, slots: int, every: int = 3, condenses: bool = True
) -> tuple[dict, list]:
    """The prompts as requests through `max_rows` rows, one joining a free row every `every` passes while the others
    decode, each released once it stops: `({label: (tokens, passes)}, rows held at each pass)`. `condenses`: whether
    the last held rows take the places of those released (`Runner._condense`); else those stay free between held rows,
    as `generate()`'s finished rows stay between rows that decode."""
    finished, held = {}, []
    with torch.inference_mode():
        first = _opened(model, prompts[0], 0, budgets[0], mode)
        rows = serving_runner(model, first, max_rows, slots)
        rows.condenses = condenses
        rows.admit(first)
        waiting = list(range(1, len(prompts)))
        for step in range(400):
            if waiting and len(rows.labels) < max_rows and step % every == 0:
                i = waiting.pop(0)
                rows.admit(_opened(model, prompts[i], i, budgets[i], mode))
            if not rows.live and not waiting:
                break
            held.append(len(rows.labels))
            rows.step()
            stopped = [(label, tokens, passes) for label, tokens, done, passes in rows.rows() if done]
            rows.release([label for label, _, _ in stopped])
            finished.update({label: (tokens, passes) for label, tokens, passes in stopped})
    return finished, held


@pytest.mark.parametrize("mode", MODES)
def test_rows_joining_between_passes_get_the_greedy_text_of_each_request_alone(trained_toy, mode, monkeypatch):
    """Six requests through three rows, one joining every few passes while the others decode: rows are reused once
    free, the cache is compacted, and every request gets greedy `generate()`'s tokens for its prompt alone."""
    compactions = []
    compact = graph_state.compact_static
    monkeypatch.setattr(graph_state, "compact_static", lambda *a: compactions.append(1) or compact(*a))
    model, tok = trained_toy
    enc = toy_prompts(tok, n=6, seed=7)
    prompts = [enc.input_ids[i, enc.attention_mask[i].bool()] for i in range(6)]
    budgets = [30, 12, 30, 20, 30, 25]
    finished, held = _serve(model, prompts, budgets, MODES[mode], 3, SLOTS[mode])
    assert sorted(finished) == list(range(6)) and max(held) == 3
    assert compactions, "the cache must have been compacted"
    took_several, processed = False, False
    processing = {key: value for key, value in MODES[mode].items() if key in PROCESSING}
    for i, prompt in enumerate(prompts):
        plain = dict(do_sample=False, max_new_tokens=budgets[i])
        alone = GenerationMixin.generate(model, prompt[None], **plain, **processing)
        tokens, passes = finished[i]
        assert tokens == alone[0, prompt.numel() :].tolist(), i
        assert 1 <= passes <= len(tokens)
        took_several |= passes < len(tokens)
        processed |= not torch.equal(alone, GenerationMixin.generate(model, prompt[None], **plain))
    assert took_several or mode.endswith("tau=1"), "the test must exercise passes that take several tokens"
    assert processed or not processing, "the processors must change some request's text"


def test_a_token_bias_holds_for_rows_that_join_after_its_first_pass(trained_toy):
    """OpenAI's `logit_bias` (a `sequence_bias` of single tokens) on requests joining one after another: the runner's
    processor prepares its bias tensor on the first row's pass, and a fresh request with the same bias still decodes
    with it (each gets biased greedy `generate()`'s text alone). The barred token is one the rows write unbiased."""
    model, tok = trained_toy
    enc = toy_prompts(tok, n=4, seed=3)
    prompts = [enc.input_ids[i, enc.attention_mask[i].bool()] for i in range(4)]
    plain = dict(do_sample=False, max_new_tokens=16)
    written = [t for p in prompts for t in GenerationMixin.generate(model, p[None], **plain)[0, p.numel() :].tolist()]
    bias = {(max(set(written), key=written.count),): -100.0}
    finished, held = _serve(model, prompts, [16] * 4, dict(mars_verify=True, sequence_bias=bias), 2, 160)
    assert sorted(finished) == list(range(4)) and max(held) == 2
    changed = False
    for i, prompt in enumerate(prompts):
        alone = GenerationMixin.generate(model, prompt[None], **plain, sequence_bias=bias)[0, prompt.numel() :]
        assert finished[i][0] == alone.tolist(), i
        changed |= not torch.equal(alone, GenerationMixin.generate(model, prompt[None], **plain)[0, prompt.numel() :])
    assert changed, "the bias must change some request's text"


def test_a_request_that_does_not_fit_or_decodes_otherwise_is_refused_by_name(trained_toy):
    model, tok = trained_toy
    prompt = toy_prompts(tok, n=1, seed=1).input_ids[0]
    with torch.inference_mode():
        first = _opened(model, prompt, "a", 30, MODES["tau=1"])
        rows = serving_runner(model, first, 2, prompt.numel() + 30)  # one short of the pass
        with pytest.raises(ValueError, match="cache slots"):
            rows.admit(first)
        other = _opened(model, prompt, "b", 4, MODES["lossless tree"])
        with pytest.raises(ValueError, match="other settings"):
            rows.admit(other)
        called = dict(mars_tau=1.0, bad_words_ids=[[5, 6]])  # a ban of two tokens: transformers' own processor
        with pytest.raises(ValueError, match="a compiled pass cannot call logits processors"):  # none compiles here
            serving_runner(model, _opened(model, prompt, "d", 4, called), 2, 200, CompileConfig())
        assert serving_runner(model, _opened(model, prompt, "d", 4, called), 2, 200).shape.calls  # an eager one does
        penalty = dict(mars_tau=1.0, repetition_penalty=1.3)
        penalised = serving_runner(model, _opened(model, prompt, "e", 4, penalty), 2, 200)
        with pytest.raises(ValueError, match="other settings"):
            penalised.admit(_opened(model, prompt, "f", 4, dict(mars_tau=1.0, repetition_penalty=1.2)))
        padded_otherwise = dict(mars_tau=1.0, pad_token_id=first.plan.pad_token_id + 1)  # the pass pads with its own
        with pytest.raises(ValueError, match="other settings"):
            rows.admit(_opened(model, prompt, "g", 4, padded_otherwise))


@pytest.mark.parametrize("mode", ["tau=1", "lossless tree"])
def test_a_minimum_of_new_tokens_holds_each_row_from_its_own_prompt(trained_toy, mode):
    """`min_new_tokens` in rows whose prompts differ in length, each row's text from column 0: every request is held
    to its own minimum, as `generate()` holds its prompt alone."""
    model, tok = trained_toy
    enc = toy_prompts(tok, n=4, seed=7)
    prompts = [enc.input_ids[i, enc.attention_mask[i].bool()] for i in range(4)]
    assert len({p.numel() for p in prompts}) > 1, "the premise: prompts of several lengths"
    plain = dict(do_sample=False, max_new_tokens=20)
    stop = int(GenerationMixin.generate(model, prompts[0][None], **plain)[0, prompts[0].numel() + 3])  # EOS here
    minimum, plain = 8, dict(plain, eos_token_id=stop)
    finished, _ = _serve(
        model, prompts, [20] * 4, dict(MODES[mode], eos_token_id=stop, min_new_tokens=minimum), 2, SLOTS[mode]
    )
    held = False
    for i, prompt in enumerate(prompts):
        alone = GenerationMixin.generate(model, prompt[None], **plain, min_new_tokens=minimum)[0, prompt.numel() :]
        assert finished[i][0] == alone.tolist(), i
        held |= not torch.equal(alone, GenerationMixin.generate(model, prompt[None], **plain)[0, prompt.numel() :])
    assert held, "the minimum must hold some request past its EOS"


@pytest.mark.parametrize("candidates, lookup", [(1, 0), (3, 0), ((2, 3, 2), 2), (1, 4)])
def test_the_full_tree_is_the_one_static_passes_propose(candidates, lookup):
    """A runner builds its shape before any of its passes: `full_tree` must be the tree a static cache's
    first pass proposes, or rows would join with drafts of another shape."""
    tok = make_tokenizer()
    model = hf_mars.to_mars(make_model("llama"), tok, block_size=4)
    enc = toy_prompts(tok, n=2, seed=1)
    mode = dict(mars_verify=True, mars_draft_candidates=candidates, mars_lookup=lookup)
    model.generate(**enc, max_new_tokens=8, cache_implementation="static", **mode)
    (shape,) = [key[0] for key in model._mars_graphs]
    assert shape.tree == full_tree(3, candidates, lookup)


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_sliding_window_rows_decode_past_the_window_as_each_request_alone(family):
    """A hybrid (Gemma 3) and an all-sliding (Mistral) model, window 8: rows that join while others decode, and
    outlive the window many times over, each get greedy `generate()`'s tokens for their prompt alone."""
    model, tok = sliding_mars_model(family)
    prompts = [tok(text, return_tensors="pt").input_ids[0] for text in ("hello world, how are", "a", "count to")]
    finished, _ = _serve(model, prompts, [30] * 3, MODES["lossless tree"], 2, SLOTS["lossless tree"], every=1)
    unwindowed, _ = sliding_mars_model(family, window=None)  # the same weights, every layer full
    windows_matter = False
    for i, prompt in enumerate(prompts):
        alone = GenerationMixin.generate(model, prompt[None], do_sample=False, max_new_tokens=30)
        assert finished[i][0] == alone[0, prompt.numel() :].tolist(), i
        windows_matter |= not torch.equal(alone, GenerationMixin.generate(unwindowed, prompt[None], max_new_tokens=30))
    assert windows_matter, "the window must change some request's text"


@pytest.mark.parametrize(
    "mode",
    [dict(mars_tau=0.5, mars_mask_cost=0.3), dict(mars_verify=True, mars_lookup=2, mars_mask_cost=[0.1, 0.5, 2])],
    ids=["tau=0.5", "lossless"],
)
def test_a_mask_schedule_serves_each_row_as_its_request_alone(trained_toy, mode):
    """A mask cost: each row keeps the schedule its prompt pass began (its rates, its last offer, its pass count),
    so every request gets the tokens and passes of its prompt decoded alone by `generate()`. (In lossless mode
    a row whose first drafts have another shape than the graph's tree verifies none in its first graph pass: one
    pass more, the same tokens.)"""
    model, tok = trained_toy
    enc = toy_prompts(tok, n=5, seed=7)
    prompts = [enc.input_ids[i, enc.attention_mask[i].bool()] for i in range(5)]
    budgets = [30, 12, 30, 20, 25]
    finished, _ = _serve(model, prompts, budgets, mode, 3, 160)
    scheduled = False
    for i, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], max_new_tokens=budgets[i], return_dict_in_generate=True, **mode)
        tokens, passes = finished[i]
        assert tokens == alone.sequences[0, prompt.numel() :].tolist(), i
        assert passes - int(alone.mars_stats.passes_per_row[0]) in ((0, 1) if mode.get("mars_verify") else (0,)), i
        every_mask = model.generate(
            prompt[None], max_new_tokens=budgets[i], **{**mode, "mars_mask_cost": 0.0}, return_dict_in_generate=True
        )
        scheduled |= int(every_mask.mars_stats.passes_per_row[0]) != passes
    assert scheduled, "the schedule must change some request's passes"


def test_a_prompts_pass_writes_its_k_v_straight_into_the_runners_rows():
    """Admission copies no K/V: the prompt's pass writes a view of the runner's own cache (the same storage), and the
    row's real slots then hold the prompt's keys and values as a forward over the prompt alone makes them."""
    tok = make_tokenizer()
    model = hf_mars.to_mars(make_model("llama"), tok, block_size=4).eval()
    enc = toy_prompts(tok, n=2, seed=3)
    prompts = [enc.input_ids[i, enc.attention_mask[i].bool()] for i in range(2)]
    with torch.inference_mode():
        first, second = (_opened(model, p, label, 8, MODES["lossless tree"]) for label, p in enumerate(prompts))
        rows = serving_runner(model, first, 3, 96)
        rows.admit(first)
        rows.step()
        rows.admit(second)  # into row 1, while row 0 decodes
        runner_keys = rows.graph.kv.layers[0].keys
        assert second.cache.kv.layers[0].keys.untyped_storage().data_ptr() == runner_keys.untyped_storage().data_ptr()
        alone = model(prompts[1][None], use_cache=True).past_key_values
        real = rows.graph.state.real[1].clone()
        real[rows.slot :] = False  # the slots the next pass writes (the prompt pass's masks' until then)
        for layer, mine in zip(alone.layers, rows.graph.kv.layers):
            written = mine.keys[1][:, real], mine.values[1][:, real]
            torch.testing.assert_close(written[0], layer.keys[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(written[1], layer.values[0], rtol=1e-4, atol=1e-5)
        assert int(real.sum()) == prompts[1].numel(), "its real slots: the prompt's (its first token is pending)"


@pytest.mark.parametrize("mode", ["tau=1", "lossless tree"])
def test_an_eager_runner_on_a_cpu_computes_the_rows_in_use_not_every_row_it_has(trained_toy, mode, monkeypatch):
    """A server's runner holds `--max-batch-size` rows, most of them free while few clients decode: on a CPU an eager
    pass feeds the rows from the first to the last that decode or hold a token to cache (`GraphPass.take_rows`;
    requests join the first free rows), and leaves out a free row between them where its compute outweighs copying
    the others' K/V (a lossless pass's tree, not τ = 1's one token). No row that decodes is left out, and every request
    still gets greedy `generate()`'s tokens alone."""
    fed, forward = [], graph._forward

    def recorded(g):
        rows = torch.arange(g.shape.batch)[g.fed_rows if g.fed_rows is not None else slice(None)]
        decoding = (~g.state.done).nonzero().flatten()
        left_out = bool(torch.isin(decoding, rows, invert=True).any())
        fed.append((rows.numel(), left_out, rows.numel() < int(rows[-1] - rows[0]) + 1))
        return forward(g)

    monkeypatch.setattr(graph, "_forward", recorded)
    model, tok = trained_toy
    enc = toy_prompts(tok, n=4, seed=5)
    prompts = [enc.input_ids[i, enc.attention_mask[i].bool()] for i in range(4)]
    budgets = [30, 12, 30, 25]  # the second row is freed while the others decode, and stays free between them
    finished, held = _serve(model, prompts, budgets, MODES[mode], 4, SLOTS[mode], every=1, condenses=False)
    assert len(fed) == len(held) and not any(left_out for _, left_out, _ in fed), "a decoding row was left out"
    assert fed[0][0] == held[0] < 4, "the first pass decodes the first requests alone"
    assert sum(rows for rows, _, _ in fed) < 4 * len(fed)
    assert any(apart for _, _, apart in fed) == (mode == "lossless tree")
    for i, prompt in enumerate(prompts):
        alone = GenerationMixin.generate(model, prompt[None], do_sample=False, max_new_tokens=budgets[i])
        assert finished[i][0] == alone[0, prompt.numel() :].tolist(), i


CONDENSED = {
    **MODES,
    "tau=0.6, n-gram bans": dict(mars_tau=0.6, no_repeat_ngram_size=3),  # a ban's copy of the text moves with its row
    "mask schedule, lossless": dict(mars_verify=True, mars_mask_cost=[0.3, 0.3, 0.3]),  # a row's schedule moves too
}


@pytest.mark.parametrize("mode", CONDENSED)
def test_rows_released_between_others_are_condensed_and_each_decodes_as_alone(trained_toy, mode, monkeypatch):
    """The second of four rows is released while the others decode: the last held row moves into its place
    (`Runner._condense`, one copy of its K/V and state), so every later pass feeds the held rows as one block from
    the first row (no free row computed, none gathered), and every request gets the tokens it gets alone: greedy
    `generate()`'s (τ-mode's and a mask schedule's, that mode's alone). The premises: some row moved, one that joined
    after the first pass (holes before its prompt, which its K/V copy leaves out)."""
    moved, fed, forward, move = [], [], graph._forward, graph_state.GraphPass.move_rows

    def recorded(g):
        decoding = (~g.state.done).nonzero().flatten()
        fed.append((g.fed_rows, decoding.tolist() == list(range(decoding.numel())), decoding.numel()))
        return forward(g)

    def moving(g, sources, targets, slots):
        moved.append((sources.tolist(), targets.tolist(), not bool(g.state.real[sources, 0].any())))
        return move(g, sources, targets, slots)

    monkeypatch.setattr(graph, "_forward", recorded)
    monkeypatch.setattr(graph_state.GraphPass, "move_rows", moving)
    model, tok = trained_toy
    enc = toy_prompts(tok, n=4, seed=5)
    prompts = [enc.input_ids[i, enc.attention_mask[i].bool()] for i in range(4)]
    budgets = [30, 12, 30, 25]
    slots = 160 if "lossless" in mode or "tau=0.6" in mode else 96
    finished, held = _serve(model, prompts, budgets, CONDENSED[mode], 4, slots, every=1)
    assert moved and moved[0] == ([3], [1], True), moved
    assert all(prefix for _, prefix, _ in fed), "the rows that decode are the first ones"
    assert all(rows is None or (rows.start, rows.stop) == (0, count) for rows, _, count in fed), fed
    plain = "tau=0.6" not in mode and "schedule" not in mode
    for i, prompt in enumerate(prompts):
        if plain:
            processing = {k: v for k, v in CONDENSED[mode].items() if k in PROCESSING}
            alone = GenerationMixin.generate(
                model, prompt[None], do_sample=False, max_new_tokens=budgets[i], **processing
            )
        else:
            alone = model.generate(prompt[None], do_sample=False, max_new_tokens=budgets[i], **CONDENSED[mode])
        assert finished[i][0] == alone[0, prompt.numel() :].tolist(), i


@pytest.mark.parametrize("weight_bound", [True, False], ids=["weights read", "FLOPs alone"])
def test_idle_rows_between_are_computed_while_a_pass_costs_its_weights_reads(trained_toy, weight_bound, monkeypatch):
    """A pass of τ = 1 feeds one column a row: a CPU's matmuls then cost reading the weights, whatever the rows, so an
    idle row between two that decode is computed rather than the others' K/V copied out and back, even for a model
    whose columns cost far more FLOPs than any copy (`GraphPass.bound_columns`). Counting FLOPs alone (no bound), the
    same pass copies. Either way every request gets greedy `generate()`'s tokens alone."""
    apart, feed = [], graph_state.GraphPass.feed_held

    def recorded(g):
        g.flops_per_column = 10**15
        g.bound_columns = g.bound_columns if weight_bound else 0
        feed(g)
        apart.append(isinstance(g.fed_rows, torch.Tensor))

    monkeypatch.setattr(graph_state.GraphPass, "feed_held", recorded)
    model, tok = trained_toy
    enc = toy_prompts(tok, n=4, seed=5)
    prompts = [enc.input_ids[i, enc.attention_mask[i].bool()] for i in range(4)]
    budgets = [30, 12, 30, 25]  # the second row is freed while the others decode, and stays free between them
    finished, _ = _serve(model, prompts, budgets, MODES["tau=1"], 4, SLOTS["tau=1"], every=1, condenses=False)
    assert any(apart) != weight_bound, apart
    for i, prompt in enumerate(prompts):
        alone = GenerationMixin.generate(model, prompt[None], do_sample=False, max_new_tokens=budgets[i])
        assert finished[i][0] == alone[0, prompt.numel() :].tolist(), i


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_an_eager_runner_attends_to_the_slots_in_use_not_every_slot_it_has(trained_toy, family):
    """On a cache far wider than the rows' texts (a server's slots), an eager runner's passes attend to a reach that
    grows in steps with the slots in use: the K/V each pass's forward reads and its mask are that long, the cache's
    own K/V are written (no copy), and every request still gets greedy `generate()`'s tokens alone, past a sliding
    window too."""
    model, tok = trained_toy if family == "llama" else sliding_mars_model(family)  # a hybrid of sliding layers
    enc = toy_prompts(tok, n=4, seed=5)
    prompts = [enc.input_ids[i, enc.attention_mask[i].bool()] for i in range(4)]
    slots, read = 1024, []

    def seen(module, args, kwargs):  # the graph passes' reach (admissions read a view as wide as their pass)
        mask = kwargs.get("attention_mask")
        mask = mask["full_attention"] if isinstance(mask, dict) else mask
        if kwargs["input_ids"].shape[0] == 2:
            read.append((kwargs[CACHE_ARG].layers[0].keys.shape[2], mask.shape[-1]))

    hook = model.register_forward_pre_hook(seen, with_kwargs=True)
    try:
        finished, _ = _serve(model, prompts, [30, 12, 30, 25], MODES["lossless tree"], 2, slots)
    finally:
        hook.remove()
    reaches = {keys for keys, _ in read}
    assert all(keys == mask for keys, mask in read), "the mask must be as wide as the K/V read"
    assert max(reaches) < slots and len(reaches) > 1 and all(r % graph_state.REACH_STEP == 0 for r in reaches), reaches
    for i, prompt in enumerate(prompts):
        alone = GenerationMixin.generate(model, prompt[None], do_sample=False, max_new_tokens=[30, 12, 30, 25][i])
        assert finished[i][0] == alone[0, prompt.numel() :].tolist(), i


def test_an_eager_runner_re_treed_between_passes_feeds_each_tree_and_keeps_greedys_text(trained_toy):
    """A server's lossless rows re-choose their draft tree as rows come and go (`Runner.retree`): a runner built for
    every tree its rows may take (`serving_runner`'s `trees`: here a 2-token chain, a 4-token tree with runner-ups and
    prompt lookup, and none) feeds the nodes and masks of the tree chosen now alone, and every row's text stays greedy
    `generate()`'s, whichever trees its passes had. Each pass moves the runner's slot on by the root and the drafts it
    fed alone, not by the widest tree's slots, and every layer's next write, the pass's first slot, follows it."""
    model, tok = trained_toy
    enc = toy_prompts(tok, n=3, seed=11)
    budget, fed, moves = 30, [], []
    chain = dict(mars_verify=True, mars_block_size=2)
    modes = [dict(mars_verify=True, mars_draft_candidates=2, mars_lookup=3), dict(mars_tau=1.0), chain]
    with torch.inference_mode():
        opened = [
            model.mars_rows(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=budget, **m)
            for m in [chain, *modes]
        ]
        runner = serving_runner(model, opened[0], 3, 160, trees=[s.plan.settings for s in opened[1:]])
        assert runner.shape.tree == full_tree(3, 2, 3), "the runner's tree: the widest of them"
        runner.admit(opened[0])
        for step in range(200):
            if not any(not done for _, _, done, _ in runner.rows()):
                break
            chosen = opened[1 + (step // 3) % 3] if step >= 3 else opened[0]  # a new tree every three passes
            runner.retree(chosen.plan.settings)
            before = runner.slot
            runner.step()
            g = runner.graph
            assert int(g.lengths[0]) == int(g.slots[0]) == runner.slot, "the device's next slot is the runner's"
            if runner.slot > before:  # no compaction in this pass
                moves.append((runner.slot - before, g.nodes_fed))
            fed.append(
                (
                    chosen.plan.settings.block_size if chosen.plan.settings.verify else 0,
                    chosen.plan.lookup,
                    runner.graph.nodes_fed,
                    runner.graph.masks_fed,
                )
            )
        texts = {label: tokens for label, tokens, _, _ in runner.rows()}
    by_tree = {}
    for block, lookup, nodes, masks in fed:
        by_tree.setdefault((block, lookup), []).append((nodes, masks))
    assert set(by_tree) == {(2, 0), (4, 3), (0, 0)}, "premise: every tree decoded some passes"
    assert all(nodes <= 1 and masks <= 1 for nodes, masks in by_tree[2, 0]), by_tree[2, 0]
    assert all(nodes == 0 and masks == 0 for nodes, masks in by_tree[0, 0]), by_tree[0, 0]
    assert max(nodes for nodes, _ in by_tree[4, 3]) > 3, "premise: the wide tree drafted beyond a chain"
    assert moves and all(moved == 1 + nodes for moved, nodes in moves), moves
    for row in range(3):
        prompt = enc.input_ids[row, enc.attention_mask[row].bool()]
        alone = GenerationMixin.generate(model, prompt[None], do_sample=False, max_new_tokens=budget)
        assert texts[row] == alone[0, prompt.numel() :].tolist(), row


def test_a_runner_whose_slot_ran_far_past_its_rows_compacts_before_its_reach_grows(trained_toy):
    """Requests joining a runner one after another move its slot on while each row holds a short text: without
    compaction its eager passes would attend to ever more slots that are holes in every row. The reach stays within
    a step of twice the fullest row's text, and every request still gets greedy `generate()`'s tokens alone."""
    model, tok = trained_toy
    enc = toy_prompts(tok, n=24, seed=13)
    prompts = [enc.input_ids[i, enc.attention_mask[i].bool()] for i in range(24)]
    budgets = [16] * 24
    reaches, feed, gathered, gather = [], graph_state.GraphPass.feed_held, [], cache._gather_slots

    def recorded(g):
        reaches.append(g.reach)
        return feed(g)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(graph_state.GraphPass, "feed_held", recorded)
        patch.setattr(
            cache, "_gather_slots", lambda states, order: gathered.append(states.shape) or gather(states, order)
        )
        finished, held = _serve(model, prompts, budgets, MODES["tau=1"], 2, 1024, every=1)
    assert sorted(finished) == list(range(24)) and max(held) == 2
    longest = max(prompt.numel() for prompt in prompts) + max(budgets) + 1  # a text and a pass (τ = 1: one token)
    assert len(held) > longest + 2 * graph_state.REACH_STEP, "premise: uncompacted, the slot moves on past that bound"
    assert max(reaches) <= 2 * longest + 2 * graph_state.REACH_STEP, reaches
    # a compaction copies the slots before the runner's, not the 1024 it has
    assert gathered and max(shape[-2] for shape in gathered) <= max(reaches), gathered
    for i, prompt in enumerate(prompts):
        alone = GenerationMixin.generate(model, prompt[None], do_sample=False, max_new_tokens=budgets[i])
        assert finished[i][0] == alone[0, prompt.numel() :].tolist(), i


def test_a_runner_on_the_cache_of_one_that_is_gone_allocates_none_and_decodes_as_alone(trained_toy):
    """A server whose rows change their settings builds a runner for the new ones on the last runner's cache (`kv`):
    no second cache is allocated, and the rows that decode on it, on slots the other's rows wrote, get greedy
    `generate()`'s tokens alone."""
    model, tok = trained_toy
    enc = toy_prompts(tok, n=4, seed=17)
    prompts = [enc.input_ids[i, enc.attention_mask[i].bool()] for i in range(4)]
    runners = []
    with torch.inference_mode():
        for mode, (a, b) in zip(("tau=1", "lossless tree"), ((0, 1), (2, 3))):
            first, second = (_opened(model, prompts[i], i, 12, MODES[mode]) for i in (a, b))
            kv = runners[-1].graph.kv if runners else None
            runners.append(serving_runner(model, first, 2, 160, kv=kv))
            runner = runners[-1]
            runner.admit(first)
            runner.admit(second)
            while not all(done for _, _, done, _ in runner.rows()):
                runner.step()
            for label, tokens, _, _ in runner.rows():
                alone = GenerationMixin.generate(model, prompts[label][None], do_sample=False, max_new_tokens=12)
                assert tokens == alone[0, prompts[label].numel() :].tolist(), (mode, label)
    assert runners[1].graph.kv is runners[0].graph.kv and runners[1].graph is not runners[0].graph


def test_a_tau_mode_pass_moves_the_slot_by_the_pending_columns_it_fed_and_keeps_the_tokens(trained_toy):
    """An eager τ-mode pass on a CPU leaves out the pending columns that are holes in every row (`narrow`'s lead: the
    rows took fewer than B tokens last pass); its first fed column lands on the pass's first slot, so the runner's
    slot moves by the pending columns fed, not by B, and the device's next slot follows it. The tokens stay those of
    the same pass feeding every column (`graph_state.NARROWS` off, as on a GPU)."""
    model, tok = trained_toy
    enc = toy_prompts(tok, n=3, seed=19)
    moves, step = [], Runner.step

    def recorded(runner, *args):
        before = runner.slot
        step(runner, *args)
        g = runner.graph
        assert int(g.slots[0]) == runner.slot, "the device's next slot is the runner's"
        if runner.slot > before:  # no compaction in this pass
            moves.append((runner.slot - before, g.shape.pending - g.lead))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Runner, "step", recorded)
        ran = model.generate(**enc, max_new_tokens=30, mars_tau=0.5)
        patch.setattr(graph_state, "NARROWS", False)
        looped = model.generate(**enc, max_new_tokens=30, mars_tau=0.5)
    assert moves and all(moved == fed for moved, fed in moves), moves
    assert any(fed < 4 for _, fed in moves), "premise: some pass left pending holes out"
    assert torch.equal(ran, looped)


def test_a_runner_takes_up_a_grammar_between_passes_and_drops_it_each_row_exact(trained_toy):
    """A plain lossless row decoding with a tree; a row that follows a JSON schema joins (the runner takes up a
    `RowGrammars`, its rows' drafts become a chain: `Runner.use_processors`), stops, and the runner drops it (the tree
    again): the plain row's text is greedy `generate()`'s alone, the schema row's constrained greedy's alone."""
    from transformers import LogitsProcessorList

    from hf_mars.grammar import GrammarProcessor, RowGrammars

    model, tok = trained_toy
    mode = MODES["lossless tree"]
    enc = toy_prompts(tok, n=2, seed=5)
    prompts = [enc.input_ids[i, enc.attention_mask[i].bool()] for i in range(2)]
    eos = model.generation_config.eos_token_id
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = GrammarProcessor.from_json_schema(schema, tok, eos_token_id=eos).grammar
    finished, drafted = {}, []

    def grammars(labels):
        processor = RowGrammars(tok, eos_token_id=eos)
        processor.assign([(label, grammar if label == "json" else None) for label in labels])
        return processor

    with torch.inference_mode():
        first = _opened(model, prompts[0], "plain", 30, mode)
        runner = serving_runner(model, first, 2, SLOTS["lossless tree"])
        runner.admit(first)
        runner.step()
        drafted.append(runner.graph.nodes_drafted)
        runner.use_processors(LogitsProcessorList([grammars(runner.row_labels)]))
        joining = model.mars_rows(
            prompts[1][None],
            labels=["json"],
            budgets=[24],
            max_new_tokens=40,
            logits_processor=[grammars(["json"])],
            **mode,
        )
        runner.admit(joining)
        runner.plan.processors[0].assign(
            [(label, grammar if label == "json" else None) for label in runner.row_labels]
        )
        while runner.live:
            runner.step()
            drafted.append(runner.graph.nodes_drafted)
            stopped = [(label, tokens) for label, tokens, done, _ in runner.rows() if done]
            runner.release([label for label, _ in stopped])
            finished.update(stopped)
            if "json" in finished and runner.plan.processors:
                runner.use_processors(LogitsProcessorList())
    chain = runner.shape.tree.parents.index(-1, 1)  # the chain's nodes come first, then the others
    assert drafted[0] is None and drafted[-1] is None, "the whole tree before the grammar and after it"
    assert any(d is not None and bool(d[:chain].all()) and not bool(d[chain:].any()) for d in drafted)
    plain = GenerationMixin.generate(model, prompts[0][None], do_sample=False, max_new_tokens=30)
    assert finished["plain"] == plain[0, prompts[0].numel() :].tolist()
    constrained = GenerationMixin.generate(
        model,
        prompts[1][None],
        do_sample=False,
        max_new_tokens=24,
        logits_processor=LogitsProcessorList([GrammarProcessor(grammar, tok, eos_token_id=eos)]),
    )
    assert finished["json"] == constrained[0, prompts[1].numel() :].tolist()
