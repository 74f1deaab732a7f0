"""The graph pass (`decoding/graph.py`): a static-cache run continues as one fixed-shape function per pass, and gives
exactly what the loop of `generate.py` gives (tokens, passes, what each pass accepted)."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from helpers import Recorder, StopRowAfterCalls, make_model, make_tokenizer, toy_prompts
from transformers import GenerationMixin, StoppingCriteriaList

import hf_mars
from hf_mars.decoding import commit, graph
from hf_mars.decoding.cache import pass_positions
from hf_mars.decoding.graph import GraphShape, _relative_positions
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


def generate(model, enc, enabled: bool = True, **kwargs):
    """Static-cache `generate()` through the graph pass (or, not `enabled`, the loop), whose passes keep their width
    and attend to every slot here, as the loop's on a static cache do (`graph.NARROWS` off, a reach as wide as any
    cache): their K/V are compared bit for bit."""
    reach_step = graph.REACH_STEP
    graph.ENABLED, graph.NARROWS, graph.REACH_STEP = enabled, False, 1 << 30
    try:
        kwargs = {"max_new_tokens": 40, "cache_implementation": "static", "return_dict_in_generate": True, **kwargs}
        return model.generate(**enc, **kwargs)
    finally:
        graph.ENABLED, graph.NARROWS, graph.REACH_STEP = True, True, reach_step


def graph_passes(model) -> int:
    """Passes run by the graph passes this model has built (each counts its own)."""
    return sum(int(g.state.step) for g in model.__dict__.get("_mars_graphs", {}).values())


@pytest.mark.parametrize("mode", MODES)
def test_the_graph_pass_gives_the_loops_tokens_and_passes(trained_toy, mode):
    model, tok = trained_toy
    model.__dict__.pop("_mars_graphs", None)
    enc = toy_prompts(tok, n=6, seed=7)  # left-padded; rows end at EOS at different passes
    looped, graphed = generate(model, enc, False, **MODES[mode]), generate(model, enc, **MODES[mode])
    assert graph_passes(model) == graphed.mars_stats.forward_passes - 1  # every pass after the prompt's
    assert torch.equal(graphed.sequences, looped.sequences)
    for name in ("new_tokens", "passes_per_row"):
        assert torch.equal(getattr(graphed.mars_stats, name), getattr(looped.mars_stats, name))
    accepted = torch.stack(graphed.mars_stats.accepted_per_step)
    assert torch.equal(accepted, torch.stack(looped.mars_stats.accepted_per_step))
    assert graphed.mars_stats.tau_per_step == looped.mars_stats.tau_per_step
    if mode != "tau=1":
        assert int(accepted.max()) > 1, "the test must exercise passes that take several tokens"
    if mode.startswith("lossless") or mode == "tau=1":
        assert torch.equal(graphed.sequences, GenerationMixin.generate(model, **enc, max_new_tokens=40))
    if "mask cost" in mode:  # the schedule offered some row fewer masks than the paper's B-1, in the graph pass
        every_mask = generate(model, enc, **{**MODES[mode], "mars_mask_cost": 0.0})
        assert not torch.equal(accepted, torch.stack(every_mask.mars_stats.accepted_per_step)[: len(accepted)])
    for a, b in zip(graphed.past_key_values.layers, looped.past_key_values.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


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

    looped = generate(model, enc, False, mars_tau=tau_reader())
    graphed = generate(model, enc, mars_tau=tau_reader())
    assert torch.equal(graphed.sequences, looped.sequences)
    assert graphed.mars_stats.tau_per_step == schedule[: graphed.mars_stats.forward_passes]
    accepted = torch.stack(graphed.mars_stats.accepted_per_step)
    assert int(accepted[4:8].max()) <= 1 and int(accepted[8:].max()) > 1


def test_transformers_own_processors_run_in_an_eager_pass_as_the_loop_calls_them(trained_toy):
    """Logits processors that only transformers applies (a bad word or bias of several tokens read the text's last
    tokens) are called on each slot's text by an eager graph pass (`GraphShape.calls`) as the loop calls them: the same
    tokens, greedy and with a seed, lossless and τ-mode (lossless: plain greedy `generate()`'s). A compiled pass cannot
    call them (`graph_shape` refuses: tests/serving/test_runner.py). The default call (no cache) runs in the graph
    pass, and so does a dynamic cache passed in with tokens in it (continued: tests/decoding/test_pass_callers.py).
    Sampling with its warpers, repetition penalties, minimum lengths, n-gram bans, bans and biases of single tokens and
    a mask schedule run in the graph pass by MARS's own rules (here and tests/decoding/test_shapes.py)."""
    model, tok = trained_toy
    enc = toy_prompts(tok, n=2, seed=9)
    model.__dict__.pop("_mars_graphs", None)
    generate(model, enc, mars_tau=0.9, do_sample=True, temperature=0.7, top_k=20)
    assert model.__dict__.get("_mars_graphs"), "sampling with history-free warpers runs in the graph pass"
    cases = [
        dict(mars_verify=True, bad_words_ids=[[5, 6]]),
        dict(mars_tau=0.9, do_sample=True, bad_words_ids=[[5, 6]]),
        dict(mars_tau=0.9, sequence_bias=[[[5, 6], 2.0]]),
    ]
    for kwargs in cases:
        model.__dict__.pop("_mars_graphs", None)
        torch.manual_seed(0)
        graphed = generate(model, enc, **kwargs)
        shapes = list(model.__dict__.get("_mars_graphs", {}))
        assert shapes and all(shape.calls for shape, *_ in shapes), kwargs
        torch.manual_seed(0)
        looped = generate(model, enc, False, **kwargs)
        assert torch.equal(graphed.sequences, looped.sequences), kwargs
        if kwargs.get("mars_verify"):
            plain = {k: v for k, v in kwargs.items() if not k.startswith("mars_")}
            expected = GenerationMixin.generate(model, **enc, max_new_tokens=40, do_sample=False, **plain)
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
def test_a_streamer_gets_the_loops_chunks_from_the_graph_pass(trained_toy, mode, stop):
    """With a streamer the run still continues as graph passes, and the streamer gets what the loop gives it: the
    prompt, then each pass's tokens as one chunk (none past a stop string), then the end."""
    model, tok = trained_toy
    one = toy_prompts(tok, n=1, seed=9)
    model.__dict__.pop("_mars_graphs", None)
    looped, graphed = Recorder(), Recorder()
    kwargs = dict(**stop, tokenizer=tok, **MODES[mode])
    out = generate(model, one, False, streamer=looped, **kwargs)
    assert generate(model, one, streamer=graphed, **kwargs).sequences.equal(out.sequences)
    assert graph_passes(model) == out.mars_stats.forward_passes - 1
    assert graphed.chunks == looped.chunks and graphed.ended and looped.ended
    assert len(graphed.chunks) == out.mars_stats.forward_passes + 1  # the prompt, then one chunk a pass
    assert max(len(chunk) for chunk in graphed.chunks[1:]) > 1, "some pass must stream several tokens"
    assert sum(map(len, graphed.chunks[1:])) == int(out.mars_stats.new_tokens[0])  # nothing past the stop
    assert not stop or int(out.mars_stats.new_tokens[0]) < 40, "the stop string must stop the row"


@pytest.mark.parametrize("mode", ["tau=0.9", "lossless tree"])
def test_stopping_criteria_and_stop_strings_are_judged_between_graph_passes(trained_toy, mode):
    """User criteria and stop strings are called on the host between graph passes, with the very tensors the loop
    shows them, and the rows they stop take nothing more: the loop's output, row by row."""
    model, tok = trained_toy
    enc = toy_prompts(tok, n=4, seed=3)
    unstopped = generate(model, enc, False, **MODES[mode])
    stop_string = text_half_way(tok, unstopped.sequences[:, enc.input_ids.shape[1] :])
    for stop in (dict(stop_strings=[stop_string], tokenizer=tok), dict(criteria=(5, 9, 13, 40))):
        runs = {}
        for enabled in (False, True):
            model.__dict__.pop("_mars_graphs", None)
            criterion = StopRowAfterCalls(stop["criteria"]) if "criteria" in stop else None
            kwargs = {k: v for k, v in stop.items() if k != "criteria"}
            if criterion is not None:
                kwargs["stopping_criteria"] = StoppingCriteriaList([criterion])
            runs[enabled] = generate(model, enc, enabled, **kwargs, **MODES[mode]), criterion, graph_passes(model)
        (looped, looked, _), (graphed, judged, passes) = runs[False], runs[True]
        assert passes > 0, "the run must continue as graph passes"
        assert torch.equal(graphed.sequences, looped.sequences)
        assert torch.equal(graphed.mars_stats.new_tokens, looped.mars_stats.new_tokens)
        assert int(looped.mars_stats.new_tokens.min()) < 40, "some row must be stopped by the criterion"
        if judged is not None:
            assert len(judged.seen) == len(looked.seen) and all(map(torch.equal, judged.seen, looked.seen))


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
    made from `pass_positions` once): the loop's positions wherever a row's pending slots are real."""
    tree, masks = DraftTree.of(parents), 3
    shape = GraphShape(2, 64, bool(parents), pending, tree, masks, "probability", 1, 0, 9, 0, 1)
    next_position = torch.tensor([5, 11])
    fed = torch.ones(2, pending + len(tree), dtype=torch.bool)
    expected = pass_positions(next_position, fed, masks, tree)
    last = next_position + pending - 1
    assert torch.equal(last[:, None] + _relative_positions(shape), expected)
    assert expected.shape[1] == shape.width


def test_cut_stops_a_row_at_its_budget_and_at_its_first_eos():
    """`cut`, shared by the loop and the graph pass: a row takes what the pass offers up to its budget, and up to and
    including the first EOS among those; an idle row takes nothing. Every placement of EOS ids, budget and offer on
    three slots, against the rule written out."""
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
    for mode in ("MARS τ = 0.9", "lossless"):
        assert rows[f"{mode}, one graph"]["ops"] < rows[f"{mode}, loop"]["ops"]
        assert rows[f"{mode}, one graph"]["kernels"] < rows[f"{mode}, loop"]["kernels"]
        assert rows[f"{mode}, one graph"]["ratio"] <= 1.5, rows[f"{mode}, one graph"]
    scheduled = "MARS τ = 0.9, measured mask cost"  # a mask schedule's books, in the graph pass too
    assert rows[f"{scheduled}, one graph"]["ops"] < rows[f"{scheduled}, loop"]["ops"]
    assert rows["plain generate()"]["ratio"] == 1.0


def test_a_lossless_pass_with_prompt_lookup_dispatches_at_most_one_and_four_tenths_plain_steps_of_ops_a_pass():
    """Prompt lookup's branch (the shipped trees carry it) in a graph pass: its search in a fixed number of ops, from
    column tables the pass made once, over a text buffer that its tail already follows, written into the tree's
    slots; with the verification of a tree, not a chain. Each further pass (the run's set-up, spread over fewer
    passes than plain's steps, cancelled out) within 1.4x a plain step's ops, within 1.6x over a short run, and under
    half the loop's."""
    from hf_mars.tools.measure.hostbound import host_bound_model, host_ops

    model, tokenizer = host_bound_model(layers=2, hidden=32)
    rows = {row["method"]: row for row in host_ops(model, tokenizer, (2,), max_new_tokens=24, decodings=("greedy",))}
    graph, loop = rows["lossless, prompt lookup 4, one graph"], rows["lossless, prompt lookup 4, loop"]
    assert graph["ops"] < loop["ops"] / 2, (graph, loop)
    assert graph["ratio"] <= 1.6, graph
    assert graph["steady_ratio"] <= 1.4, graph


def test_the_default_call_decodes_in_the_runner_with_no_more_ops_at_tau_1_than_plains_dynamic_step():
    """`generate()`'s default call (no cache argument) decodes in the eager runner, not the loop: at τ = 1 (one token a
    pass, plain decoding's tokens) each further pass dispatches no more ops than plain's own step on its dynamic cache
    (the loop's books took 3x), and every mode's pass no more than the same pass on a static cache (`"one graph"`)."""
    from hf_mars.tools.measure.hostbound import host_bound_model, host_ops

    model, tokenizer = host_bound_model(layers=2, hidden=32)
    counts = host_ops(model, tokenizer, (2,), max_new_tokens=24, decodings=("greedy",), default=("greedy",))
    default = {row["method"]: row for row in counts if row["decoding"] == "greedy, default call"}
    static = {row["method"]: row for row in counts if row["decoding"] == "greedy"}
    assert default["plain generate()"]["steady"] < static["plain generate()"]["steady"], "premise: plain's own cache"
    assert default["MARS τ = 1, runner"]["steady_ratio"] <= 1.0, default["MARS τ = 1, runner"]
    for method, row in default.items():
        if method != "plain generate()":
            graphed = static[method.replace(", runner", ", one graph")]
            assert row["steady"] <= graphed["steady"], (method, row["steady"], graphed["steady"])


def test_a_sampled_graph_pass_dispatches_at_most_one_and_a_half_plain_sampled_steps_of_ops():
    """The same count for sampling (T = 0.7, top-k 50), against a plain sampled step: τ-mode's pass draws every slot
    in one call of the warpers, and every mode's graph pass dispatches fewer ops than the loop's."""
    from hf_mars.tools.measure.hostbound import host_bound_model, host_ops

    model, tokenizer = host_bound_model(layers=2, hidden=32)
    decoding = "sampled (T = 0.7, top-k 50)"
    counts = host_ops(model, tokenizer, batch_sizes=(2,), max_new_tokens=24, decodings=(decoding,))
    rows = {row["method"]: row for row in counts}
    for mode in ("MARS τ = 1", "MARS τ = 0.9", "lossless"):
        assert rows[f"{mode}, one graph"]["ops"] < rows[f"{mode}, loop"]["ops"], mode
    for mode in ("MARS τ = 1", "MARS τ = 0.9"):
        assert rows[f"{mode}, one graph"]["ratio"] <= 1.5, rows[f"{mode}, one graph"]
    assert rows["lossless, one graph"]["ratio"] <= 1.6, rows["lossless, one graph"]  # speculative sampling's books


def test_a_lossless_pass_with_a_repetition_penalty_scores_every_slot_at_once():
    """Lossless mode with a repetition penalty scores its every slot, nodes and masks, in one application
    (`scoring.scored_at_once`), not the masks one at a time after the verified tokens: its graph pass stays within
    1.5x a plain penalised step's ops, and under the loop's."""
    from hf_mars.tools.measure.hostbound import host_bound_model, host_ops

    model, tokenizer = host_bound_model(layers=2, hidden=32)
    decoding = "greedy, repetition penalty 1.2"
    rows = {row["method"]: row for row in host_ops(model, tokenizer, (2,), max_new_tokens=24, decodings=(decoding,))}
    assert rows["lossless, one graph"]["ops"] < rows["lossless, loop"]["ops"]
    assert rows["lossless, one graph"]["ratio"] <= 1.5, rows["lossless, one graph"]


def test_a_sampled_penalised_graph_pass_dispatches_at_most_one_and_a_half_plain_steps_of_ops():
    """Sampling with a repetition penalty, what chat traffic sends: τ-mode draws slot by slot, each after the tokens
    drawn before it, and lossless mode samples speculatively; both within 1.5x a plain sampled, penalised step's ops
    (the warpers by their own arithmetic, the tokens each history holds carried from pass to pass)."""
    from hf_mars.tools.measure.hostbound import host_bound_model, host_ops

    model, tokenizer = host_bound_model(layers=2, hidden=32)
    decoding = "sampled, repetition penalty 1.2"
    rows = {row["method"]: row for row in host_ops(model, tokenizer, (2,), max_new_tokens=48, decodings=(decoding,))}
    for mode in ("MARS τ = 0.9", "lossless"):
        assert rows[f"{mode}, one graph"]["ops"] < rows[f"{mode}, loop"]["ops"], mode
        assert rows[f"{mode}, one graph"]["ratio"] <= 1.5, rows[f"{mode}, one graph"]


def test_a_mask_schedule_over_a_penalty_or_an_ngram_ban_dispatches_at_most_one_and_a_half_plain_steps_of_ops(
    monkeypatch,
):
    """A mask schedule (a fixed `mars_mask_cost`, so that every machine schedules) on top of the processors that τ-mode
    applies slot by slot: sampling with a repetition penalty, and an n-gram ban. Its books (offers, each mask's τ by
    the row's offer, the rates' moves) and the slots' (a kept text copy for the bans, the random numbers drawn into a
    kept buffer) stay within 1.5x a plain step's ops over a 48-token run, and each further pass within 1.45x."""
    from hf_mars.tools.measure import hostbound

    monkeypatch.setattr(hostbound, "MODES", {"scheduled": dict(mars_tau=0.9, mars_mask_cost=0.3)})
    model, tokenizer = hostbound.host_bound_model(layers=2, hidden=32)
    for decoding in ("sampled, repetition penalty 1.2", "greedy, no_repeat_ngram_size 3"):
        counts = hostbound.host_ops(model, tokenizer, (2,), max_new_tokens=48, decodings=(decoding,))
        rows = {row["method"]: row for row in counts}
        graph, loop = rows["scheduled, one graph"], rows["scheduled, loop"]
        assert graph["ops"] < loop["ops"], (decoding, graph, loop)
        assert graph["ratio"] <= 1.5, (decoding, graph)
        assert graph["steady_ratio"] <= 1.45, (decoding, graph)


def test_a_graph_pass_carries_the_tokens_each_history_holds_as_the_text_holds_them(trained_toy):
    """A graph pass finds which tokens each row's history holds when rows are loaded, then adds each pass's taken
    tokens (`GraphPass.held`): after a run, what it carries equals what the text it wrote holds, found anew."""
    model, tok = trained_toy
    model.__dict__.pop("_mars_graphs", None)
    enc = toy_prompts(tok, n=3, seed=11)
    penalised = dict(max_new_tokens=20, do_sample=False, repetition_penalty=1.3, cache_implementation="static")
    for mode in (dict(mars_tau=0.9), dict(mars_verify=True)):
        model.generate(**enc, **penalised, **mode)
    passes = [g for g in model._mars_graphs.values() if g.held]
    assert len(passes) == 2 and all(int(g.state.step) > 1 for g in passes)
    for g in passes:
        found = g.histories(found=False).seen(g.vocab)
        assert all(torch.equal(held, anew) for held, anew in zip(g.held, found))
        assert torch.equal(g.state.text_end, g.text_start + g.state.decoded)


def test_an_ngram_ban_runs_in_the_graph_pass_with_fewer_ops_than_the_loop():
    """`no_repeat_ngram_size` by MARS's rule (`scoring.NGRAM_BANS`) runs in the graph pass, and each mode's graph
    pass dispatches fewer ops than the loop's pass, which applies the same rule around a dynamic frame. Lossless
    mode bans for every slot at once (its drafts a chain, each slot's history a prefix of one text): within 1.5x a
    plain step's ops with the same ban. τ-mode bans slot by slot, from windows made once a pass over a copy of the
    text that holds the spare id past each history (no window is then checked against it) and each chosen token is
    written into: within 1.6x."""
    from hf_mars.tools.measure.hostbound import host_bound_model, host_ops

    model, tokenizer = host_bound_model(layers=2, hidden=32)
    decoding = "greedy, no_repeat_ngram_size 3"
    rows = {row["method"]: row for row in host_ops(model, tokenizer, (2,), max_new_tokens=24, decodings=(decoding,))}
    for mode in ("MARS τ = 1", "MARS τ = 0.9", "lossless"):
        assert rows[f"{mode}, one graph"]["ops"] < rows[f"{mode}, loop"]["ops"], mode
    assert rows["lossless, one graph"]["ratio"] <= 1.5, rows["lossless, one graph"]
    assert rows["MARS τ = 0.9, one graph"]["ratio"] <= 1.6, rows["MARS τ = 0.9, one graph"]


def test_an_untrained_qwen2_runs_every_mode_through_the_graph_as_the_loop_does():
    tok = make_tokenizer()
    model = hf_mars.to_mars(make_model("qwen2"), tok, block_size=4)
    enc = toy_prompts(tok, n=3, seed=1)
    for mode in MODES.values():
        looped, graphed = generate(model, enc, False, **mode), generate(model, enc, **mode)
        assert torch.equal(graphed.sequences, looped.sequences), mode


def test_a_copy_or_another_dtype_of_the_model_builds_its_own_graph_passes():
    import copy

    tok = make_tokenizer()
    model = hf_mars.to_mars(make_model("llama"), tok, block_size=4)
    enc = toy_prompts(tok, n=2, seed=4)
    first = generate(model, enc, mars_verify=True).sequences
    assert model._mars_graphs
    twin = copy.deepcopy(model)
    assert not twin.__dict__.get("_mars_graphs")
    assert torch.equal(generate(twin, enc, mars_verify=True).sequences, first)
    twin.to(torch.bfloat16)
    looped = generate(twin, enc, False, mars_verify=True).sequences
    assert torch.equal(generate(twin, enc, mars_verify=True).sequences, looped)
    assert {key[-2] for key in twin._mars_graphs} == {torch.float32, torch.bfloat16}  # (..., dtype, device)


def test_a_compiled_graph_pass_compiles_every_shape_past_torchs_default_limit():
    """Torch compiles 8 shapes of a function, then runs the rest eagerly; a process of MARS passes meets more (batch
    sizes, modes, the trees `"auto"` times), and each must run compiled."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from transformers import CompileConfig

    tok = make_tokenizer()
    model = hf_mars.to_mars(make_model("llama", hidden_size=40, num_attention_heads=2), tok, block_size=3)
    config = CompileConfig(backend="eager")
    config._compile_all_devices = True  # generate() compiles on GPUs only unless told
    compiled = lambda: len(_debug_get_cache_entry_list(graph.graph_pass.__code__))  # noqa: E731
    before, shapes = compiled(), range(1, 11)  # this model's width: shapes no other test compiled
    assert torch._dynamo.config.recompile_limit < len(shapes)
    for rows in shapes:
        enc = toy_prompts(tok, n=rows, seed=2)
        out = generate(model, enc, compile_config=config, max_new_tokens=8, mars_tau=0.9)
        assert torch.equal(out.sequences, generate(model, enc, False, max_new_tokens=8, mars_tau=0.9).sequences)
    assert compiled() - before == len(shapes)


def test_a_pass_compiled_whole_draws_a_seeds_tokens():
    """Off a GPU the whole pass is compiled by inductor, whose own random numbers differ from eager's: it draws with
    eager's generator, so at τ = 1 a seed gives plain compiled `generate()`'s sampled tokens, and in lossless mode
    the loop's."""
    from transformers import CompileConfig

    tok = make_tokenizer()
    model = hf_mars.to_mars(make_model("llama", hidden_size=40, num_attention_heads=2), tok, block_size=3)
    config = CompileConfig(backend="inductor")
    config._compile_all_devices = True
    enc = toy_prompts(tok, n=3, seed=2)
    sampled = dict(max_new_tokens=12, do_sample=True, temperature=0.7, top_k=20, repetition_penalty=1.3)

    def seeded(call, **kwargs):
        torch.manual_seed(0)
        return call(**enc, **sampled, **kwargs)

    compiled = dict(compile_config=config, cache_implementation="static")
    plain = seeded(functools.partial(GenerationMixin.generate, model), **compiled)
    assert torch.equal(seeded(model.generate, mars_tau=1.0, **compiled), plain)
    lossless = dict(mars_verify=True, mars_lookup=2)
    in_graph = seeded(model.generate, **lossless, **compiled)
    torch.manual_seed(0)
    assert torch.equal(in_graph, generate(model, enc, False, **sampled, **lossless).sequences)


BY_RULE = {  # lossless passes verified by `verify.verify` (not the greedy match of raw logits)
    "sampled": dict(do_sample=True, temperature=0.7, top_k=20),
    "typical": dict(mars_accept="typical", mars_draft_candidates=2, mars_lookup=2),
    "penalised tree": dict(repetition_penalty=1.3, mars_draft_candidates=2, mars_lookup=2),
}


@pytest.mark.parametrize("mode", BY_RULE)
def test_a_graph_pass_makes_no_tensor_from_host_data(trained_toy, mode, monkeypatch):
    """Compiled whole (CPUs; on a GPU, the fused pass), a pass that makes a tensor from host data (a tree's tables, a
    `torch.tensor` of Python numbers) copies it to the device in every pass, which CUDA graph capture refuses. Every
    table a pass reads is made once, when the pass is built: here no pass makes one, by any path of verification."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model, tok = trained_toy
    made, inside, passes = [], [False], []

    class HostData(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if inside[0] and func is torch.ops.aten.lift_fresh.default:
                made.append("torch.tensor")
            return func(*args, **(kwargs or {}))

    def on(tree, device):
        if inside[0]:
            made.append(f"tree tables {tree.parents}")
        return on_device(tree, device)

    def traced(g):
        inside[0] = True
        passes.append(g)
        try:
            run_pass(g)
        finally:
            inside[0] = False

    on_device, run_pass = DraftTree.on, graph.graph_pass
    monkeypatch.setattr(DraftTree, "on", on)
    monkeypatch.setattr(graph, "graph_pass", traced)
    model.__dict__.pop("_mars_graphs", None)
    enc = toy_prompts(tok, n=3, seed=5)
    torch.manual_seed(0)
    with HostData():
        out = generate(model, enc, mars_verify=True, **BY_RULE[mode])
    model.__dict__.pop("_mars_graphs", None)
    assert len(passes) == out.mars_stats.forward_passes - 1 > 1, "the run must continue in graph passes"
    assert not made, made
