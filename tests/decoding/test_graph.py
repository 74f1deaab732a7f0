"""The graph pass (`decoding/graph.py`): a static-cache run continues as one fixed-shape function per pass, exactly
`generate()`'s where MARS does not change the tokens (lossless mode, τ = 1), batched as alone; what the host serves
between passes (criteria, stop strings, streamers) as `generate()` serves it. τ-mode's tokens against a decoder with
no cache at all: tests/decoding/test_generation.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import Recorder, StopRowAfterCalls, toy_prompts
from transformers import GenerationMixin, StoppingCriteriaList

from hf_mars.decoding import commit, graph_state
from hf_mars.decoding.cache import pass_positions
from hf_mars.decoding.graph_state import GraphShape, _relative_positions
from hf_mars.decoding.tree import DraftTree

MODES = {
    "tau=0.9": dict(mars_tau=0.9),
    "tau=0": dict(mars_tau=0.0),
    "tau=1": dict(mars_tau=1.0),
    "lossless chain": dict(mars_verify=True),
    "lossless tree": dict(mars_verify=True, mars_block_size=2, mars_draft_candidates=3, mars_lookup=4),
    "lossless per-depth tree": dict(mars_verify=True, mars_draft_candidates=[2, 3, 2], mars_lookup=2),
    "lossless at tau=1": dict(mars_verify=True, mars_tau=1.0, mars_lookup=4),  # the masks propose nothing
    "tau=0.5 mask cost": dict(mars_tau=0.5, mars_mask_cost=0.3),
    "lossless mask cost": dict(mars_verify=True, mars_draft_candidates=2, mars_lookup=2, mars_mask_cost=[0.1, 0.5, 2]),
}


def generate(model, enc, **kwargs):
    """Static-cache `generate()` through the graph pass, whose passes keep their width and attend to every slot here,
    as a captured pass on a GPU does (`graph_state.NARROWS` off, a reach as wide as any cache)."""
    reach_step = graph_state.REACH_STEP
    graph_state.NARROWS, graph_state.REACH_STEP = False, 1 << 30
    try:
        kwargs = {"max_new_tokens": 40, "cache_implementation": "static", "return_dict_in_generate": True, **kwargs}
        return model.generate(**enc, **kwargs)
    finally:
        graph_state.NARROWS, graph_state.REACH_STEP = True, reach_step


def graph_passes(model) -> int:
    """Passes run by the graph passes this model has built (each counts its own)."""
    return sum(int(g.state.logged) for g in model.__dict__.get("_mars_graphs", {}).values())


@pytest.mark.parametrize("mode", MODES)
def test_every_pass_after_the_prompts_is_a_graph_pass_with_the_stats_it_ran(trained_toy, mode):
    """Every pass after the prompt's runs in the graph pass; the stats count each row's tokens and passes as the text
    holds them (a row takes a token in every pass it decodes in), and lossless mode and τ = 1 give `generate()`'s."""
    model, tok = trained_toy
    model.__dict__.pop("_mars_graphs", None)
    enc = toy_prompts(tok, n=6, seed=7)  # left-padded; rows end at EOS at different passes
    graphed = generate(model, enc, **MODES[mode])
    assert graph_passes(model) == graphed.mars_stats.forward_passes - 1  # every pass after the prompt's
    accepted = torch.stack(graphed.mars_stats.accepted_per_step)
    stats = graphed.mars_stats
    assert torch.equal(stats.new_tokens, accepted.sum(dim=0)) and torch.equal(
        stats.passes_per_row, (accepted > 0).sum(0)
    )
    assert len(stats.tau_per_step) == stats.forward_passes
    if mode != "tau=1":
        assert int(accepted.max()) > 1, "the test must exercise passes that take several tokens"
    if mode.startswith("lossless") or mode == "tau=1":
        assert torch.equal(graphed.sequences, GenerationMixin.generate(model, **enc, max_new_tokens=40))
    if "mask cost" in mode:  # the schedule offered some row fewer masks than the paper's B-1, in the graph pass
        every_mask = generate(model, enc, **{**MODES[mode], "mars_mask_cost": 0.0})
        assert not torch.equal(accepted, torch.stack(every_mask.mars_stats.accepted_per_step)[: len(accepted)])


def test_batched_equals_unbatched_and_one_graph_serves_every_call(trained_toy):
    """Rows of a graph pass never see each other; calls with other prompts and lengths (one `max_cache_len`) reuse
    the graph pass built by the first, its buffers and its cache loaded anew."""
    model, tok = trained_toy
    model.__dict__.pop("_mars_graphs", None)
    enc = toy_prompts(tok, n=4, seed=3)
    mode = dict(mars_verify=True, mars_draft_candidates=2, mars_lookup=3, max_cache_len=600)
    batched = generate(model, enc, **mode).sequences[:, enc.input_ids.shape[1] :]
    built = dict(model._mars_graphs)
    assert len(built) == 1
    for row in range(4):
        ids = enc.input_ids[row : row + 1, enc.attention_mask[row].bool()]
        alone = generate(model, {"input_ids": ids}, **mode).sequences[0, ids.shape[1] :]
        assert torch.equal(alone, batched[row, : alone.shape[0]])
        assert (batched[row, alone.shape[0] :] == tok.pad_token_id).all()
    assert torch.equal(generate(model, enc, **mode).sequences[:, enc.input_ids.shape[1] :], batched)
    batch_of_one = [key for key in model._mars_graphs if key not in built]
    assert len(batch_of_one) == 1 and all(model._mars_graphs[key] is value for key, value in built.items())


def test_live_tau_is_read_before_every_graph_pass(trained_toy):
    """A callable τ keeps B-1 masks in every pass (the shape stays); τ >= 1 then accepts slot 0 alone."""
    model, tok = trained_toy
    enc = toy_prompts(tok, n=3, seed=5)
    schedule = [0.9] * 4 + [1.0] * 4 + [0.3] * 100

    def tau_reader():
        values = iter(schedule)
        return lambda: next(values)

    graphed = generate(model, enc, mars_tau=tau_reader())
    assert graphed.mars_stats.tau_per_step == schedule[: graphed.mars_stats.forward_passes]
    accepted = torch.stack(graphed.mars_stats.accepted_per_step)
    assert int(accepted[4:8].max()) <= 1 and int(accepted[8:].max()) > 1


def test_transformers_own_processors_run_in_an_eager_pass_as_generate_calls_them(trained_toy):
    """Logits processors that only transformers applies (a bad word or bias of several tokens read the text's last
    tokens) are called on each slot's text by an eager graph pass (`GraphShape.calls`): lossless mode and τ = 1, greedy
    and with a seed, give plain `generate()`'s tokens with the same processors. A compiled pass cannot call them
    (`graph_shape` refuses: tests/serving/test_runner.py). The default call (no cache) runs in the graph pass, and so
    does a dynamic cache passed in with tokens in it (continued: tests/decoding/test_pass_callers.py). Sampling with
    its warpers, repetition penalties, minimum lengths, n-gram bans, bans and biases of single tokens and a mask
    schedule run in the graph pass by MARS's own rules (here and tests/decoding/test_shapes.py)."""
    model, tok = trained_toy
    enc = toy_prompts(tok, n=2, seed=9)
    model.__dict__.pop("_mars_graphs", None)
    generate(model, enc, mars_tau=0.9, do_sample=True, temperature=0.7, top_k=20)
    assert model.__dict__.get("_mars_graphs"), "sampling with history-free warpers runs in the graph pass"
    cases = [
        dict(mars_verify=True, bad_words_ids=[[5, 6]]),
        dict(mars_tau=1.0, do_sample=True, bad_words_ids=[[5, 6]]),
        dict(mars_tau=1.0, sequence_bias=[[[5, 6], 2.0]]),
        dict(mars_tau=0.9, do_sample=True, bad_words_ids=[[5, 6]]),
        dict(mars_tau=0.9, sequence_bias=[[[5, 6], 2.0]]),
    ]
    for kwargs in cases:
        model.__dict__.pop("_mars_graphs", None)
        torch.manual_seed(0)
        graphed = generate(model, enc, **kwargs)
        shapes = list(model.__dict__.get("_mars_graphs", {}))
        assert shapes and all(shape.calls for shape, *_ in shapes), kwargs
        if kwargs.get("mars_verify") or kwargs["mars_tau"] >= 1.0:
            plain = {k: v for k, v in kwargs.items() if not k.startswith("mars_")}
            torch.manual_seed(0)
            expected = GenerationMixin.generate(model, **enc, max_new_tokens=40, **{"do_sample": False, **plain})
            assert torch.equal(graphed.sequences, expected), kwargs
    model.__dict__.pop("_mars_graphs", None)
    first = model.generate(**enc, max_new_tokens=10, mars_tau=0.9, return_dict_in_generate=True)  # no cache passed
    assert model.__dict__.get("_mars_graphs"), "the default call runs in the graph pass"
    model.__dict__.pop("_mars_graphs", None)
    more = torch.cat([first.sequences, first.sequences[:, -1:]], dim=1)
    mask = torch.cat([enc.attention_mask, torch.ones_like(more[:, enc.input_ids.shape[1] :])], dim=1)
    model.generate(more, attention_mask=mask, past_key_values=first.past_key_values, max_new_tokens=5, mars_tau=0.9)
    assert model.__dict__.get("_mars_graphs"), "a dynamic cache passed in full is continued in the graph pass"


@pytest.mark.parametrize("stop", [{}, dict(stop_strings=["w"])], ids=["eos", "stop string"])
@pytest.mark.parametrize("mode", ["tau=0.9", "lossless tree"])
def test_a_streamer_gets_the_prompt_then_each_passs_tokens_from_the_graph_pass(trained_toy, mode, stop):
    """With a streamer the run still continues as graph passes, and the streamer gets the prompt, then each pass's
    tokens as one chunk (none past a stop string), then the end: the output's tokens, in order."""
    model, tok = trained_toy
    one = toy_prompts(tok, n=1, seed=9)
    model.__dict__.pop("_mars_graphs", None)
    graphed = Recorder()
    kwargs = dict(**stop, tokenizer=tok, **MODES[mode])
    out = generate(model, one, streamer=graphed, **kwargs)
    assert graph_passes(model) == out.mars_stats.forward_passes - 1
    assert graphed.ended and graphed.chunks[0] == one.input_ids[0].tolist()
    assert len(graphed.chunks) == out.mars_stats.forward_passes + 1  # the prompt, then one chunk a pass
    assert max(len(chunk) for chunk in graphed.chunks[1:]) > 1, "some pass must stream several tokens"
    new = int(out.mars_stats.new_tokens[0])  # nothing past the stop
    assert sum(graphed.chunks[1:], []) == out.sequences[0, one.input_ids.shape[1] :][:new].tolist()
    assert not stop or new < 40, "the stop string must stop the row"


@pytest.mark.parametrize("mode", ["tau=0.9", "lossless tree"])
def test_stopping_criteria_and_stop_strings_are_judged_between_graph_passes(trained_toy, mode):
    """User criteria and stop strings are called on the host between graph passes, on the text as it stands, and the
    rows they stop take nothing more: each row is the unstopped run's row cut where it was stopped (rows never see
    each other)."""
    model, tok = trained_toy
    enc = toy_prompts(tok, n=4, seed=3)
    prompt = enc.input_ids.shape[1]
    unstopped = generate(model, enc, **MODES[mode])
    stop_string = text_half_way(tok, unstopped.sequences[:, prompt:])
    for stop in (dict(stop_strings=[stop_string], tokenizer=tok), dict(criteria=(5, 9, 13, 40))):
        model.__dict__.pop("_mars_graphs", None)
        criterion = StopRowAfterCalls(stop["criteria"]) if "criteria" in stop else None
        kwargs = {k: v for k, v in stop.items() if k != "criteria"}
        if criterion is not None:
            kwargs["stopping_criteria"] = StoppingCriteriaList([criterion])
        graphed = generate(model, enc, **kwargs, **MODES[mode])
        assert graph_passes(model) > 0, "the run must continue as graph passes"
        new = graphed.mars_stats.new_tokens
        assert bool((new < unstopped.mars_stats.new_tokens).any()), "some row must be stopped early"
        for row, count in enumerate(new.tolist()):
            cut = unstopped.sequences[row, prompt : prompt + count]
            assert torch.equal(graphed.sequences[row, prompt : prompt + count], cut), (stop, row)
        if criterion is not None:  # called once a pass, after the prompt's pass too, on the text as it stands
            assert len(criterion.seen) >= graphed.mars_stats.forward_passes - 1
            assert all(seen.shape[0] == 4 and seen.shape[1] >= prompt for seen in criterion.seen)
        else:
            texts = tok.batch_decode(graphed.sequences[:, prompt:], skip_special_tokens=True)
            assert any(stop_string in text for text in texts), "the stop string must stop some row"


def text_half_way(tok, new_tokens) -> str:
    """A stop string taken from this run's own text: the longest row's token half-way through it. The toy model is
    trained in the test session, and its text differs with the CPU's kernels, so no string fixed in advance is sure
    to appear."""
    lengths = (new_tokens != tok.pad_token_id).sum(dim=1)
    row = int(lengths.argmax())
    for index in range(int(lengths[row]) // 2, int(lengths[row])):
        text = tok.decode(new_tokens[row, index : index + 1])
        if text.strip():
            return text
    raise AssertionError(f"row {row} decoded no visible text: {tok.decode(new_tokens[row])!r}")


@pytest.mark.parametrize("parents", [(), (-1, 0, 1), (-1, 0, 1, -1, -1, 0, -1, 4)])
@pytest.mark.parametrize("pending", [1, 4])
def test_relative_positions_are_the_caches_positions(parents, pending):
    """A graph pass finds its positions as each row's last pending position plus one table (`_relative_positions`,
    made from `pass_positions` once): the prompt's pass's positions wherever a row's pending slots are real."""
    tree, masks = DraftTree.of(parents), 3
    shape = GraphShape(2, 64, bool(parents), pending, tree, masks, "probability", 1, 0, 9, 0, 1)
    next_position = torch.tensor([5, 11])
    fed = torch.ones(2, pending + len(tree), dtype=torch.bool)
    expected = pass_positions(next_position, fed, masks, tree)
    last = next_position + pending - 1
    assert torch.equal(last[:, None] + _relative_positions(shape), expected)
    assert expected.shape[1] == shape.width


def test_cut_stops_a_row_at_its_budget_and_at_its_first_eos():
    """`cut`, shared by the prompt's pass and the graph pass: a row takes what the pass offers up to its budget, and
    up to and including the first EOS among those; an idle row takes nothing. Every placement of EOS ids, budget and
    offer on three slots, against the rule written out."""
    eos, other = torch.tensor([7, 9]), 4
    cases = [
        (tokens, offered, left, idle)
        for tokens in itertools.product([other, 7, 9], repeat=3)
        for offered in (1, 2, 3)
        for left in (1, 2, 3, 5)
        for idle in (False, True)
    ]
    tokens, offered, left, idle = (torch.tensor(column) for column in zip(*cases))
    accepted, ended = commit.cut(tokens, offered, left, idle, eos)
    for row, (text, offer, budget, still) in enumerate(cases):
        take = 0 if still else min(offer, budget)
        first_eos = next((i for i, token in enumerate(text[:take]) if token in (7, 9)), None)
        expected = take if first_eos is None else first_eos + 1
        assert accepted[row] == expected, cases[row]
        assert bool(ended[row]) == (take >= budget or first_eos is not None), cases[row]
    assert bool((accepted < offered.clamp(max=left)).any()) and bool(ended.any()) and not bool(ended.all())
    no_eos, _ = commit.cut(tokens, offered, left, idle, torch.tensor([], dtype=torch.long))
    assert torch.equal(no_eos, torch.where(idle, 0, torch.minimum(offered, left)))


def test_the_graph_pass_dispatches_at_most_one_and_a_half_plain_steps_of_ops():
    """aten ops outside the forward, per pass, static cache, eager (`hf-mars bench --host-bound` prints them): what a
    GPU launches around the forward when the pass is not captured. A count, not a timing: the same on every machine."""
    from hf_mars.tools.measure.hostbound import host_bound_model, host_ops

    model, tokenizer = host_bound_model(layers=2, hidden=32)
    rows = {row["method"]: row for row in host_ops(model, tokenizer, batch_sizes=(2,), max_new_tokens=24)}
    for mode in ("MARS τ = 0.9", "lossless", "MARS τ = 0.9, measured mask cost"):
        assert rows[mode]["ratio"] <= 1.5, rows[mode]
    assert rows["plain generate()"]["ratio"] == 1.0


def test_a_lossless_pass_with_prompt_lookup_dispatches_at_most_one_and_four_tenths_plain_steps_of_ops_a_pass():
    """Prompt lookup's branch (the shipped trees carry it) in a graph pass: its search in a fixed number of ops, from
    column tables the pass made once, over a text buffer that its tail already follows, written into the tree's
    slots; with the verification of a tree, not a chain. Each further pass (the run's set-up, spread over fewer
    passes than plain's steps, cancelled out) within 1.4x a plain step's ops, within 1.6x over a short run."""
    from hf_mars.tools.measure.hostbound import host_bound_model, host_ops

    model, tokenizer = host_bound_model(layers=2, hidden=32)
    rows = {row["method"]: row for row in host_ops(model, tokenizer, (2,), max_new_tokens=24, decodings=("greedy",))}
    graph = rows["lossless, prompt lookup 4"]
    assert graph["ratio"] <= 1.6, graph
    assert graph["steady_ratio"] <= 1.4, graph


def test_the_default_call_decodes_in_the_runner_with_no_more_ops_at_tau_1_than_plains_dynamic_step():
    """`generate()`'s default call (no cache argument) decodes in the eager runner: at τ = 1 (one token a pass, plain
    decoding's tokens) each further pass dispatches no more ops than plain's own step on its dynamic cache, and every
    mode's pass no more than the same pass on a static cache."""
    from hf_mars.tools.measure.hostbound import host_bound_model, host_ops

    model, tokenizer = host_bound_model(layers=2, hidden=32)
    counts = host_ops(model, tokenizer, (2,), max_new_tokens=24, decodings=("greedy",), default=("greedy",))
    default = {row["method"]: row for row in counts if row["decoding"] == "greedy, default call"}
    static = {row["method"]: row for row in counts if row["decoding"] == "greedy"}
    assert default["plain generate()"]["steady"] < static["plain generate()"]["steady"], "premise: plain's own cache"
    assert default["MARS τ = 1"]["steady_ratio"] <= 1.0, default["MARS τ = 1"]
    for method, row in default.items():
        if method != "plain generate()":
            assert row["steady"] <= static[method]["steady"], (method, row["steady"], static[method]["steady"])


def test_a_sampled_graph_pass_dispatches_at_most_one_and_a_half_plain_sampled_steps_of_ops():
    """The same count for sampling (T = 0.7, top-k 50), against a plain sampled step: τ-mode's pass draws every slot
    in one call of the warpers."""
    from hf_mars.tools.measure.hostbound import host_bound_model, host_ops

    model, tokenizer = host_bound_model(layers=2, hidden=32)
    decoding = "sampled (T = 0.7, top-k 50)"
    counts = host_ops(model, tokenizer, batch_sizes=(2,), max_new_tokens=24, decodings=(decoding,))
    rows = {row["method"]: row for row in counts}
    for mode in ("MARS τ = 1", "MARS τ = 0.9"):
        assert rows[mode]["ratio"] <= 1.5, rows[mode]
    assert rows["lossless"]["ratio"] <= 1.6, rows["lossless"]  # speculative sampling's books


def test_a_lossless_pass_with_a_repetition_penalty_scores_every_slot_at_once():
    """Lossless mode with a repetition penalty scores its every slot, nodes and masks, in one application
    (`scoring.scored_at_once`), not the masks one at a time after the verified tokens: its graph pass stays within
    1.5x a plain penalised step's ops."""
    from hf_mars.tools.measure.hostbound import host_bound_model, host_ops

    model, tokenizer = host_bound_model(layers=2, hidden=32)
    decoding = "greedy, repetition penalty 1.2"
    rows = {row["method"]: row for row in host_ops(model, tokenizer, (2,), max_new_tokens=24, decodings=(decoding,))}
    assert rows["lossless"]["ratio"] <= 1.5, rows["lossless"]
