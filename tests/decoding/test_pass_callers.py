"""Which function runs each MARS pass: a forward pre-hook on the model records its caller. Where a runner decodes
(`generate()` without a cache or on a static one, a server's rows), every pass after a prompt's is the
graph pass's forward and each prompt's pass the session's: one function for every pass, one other for prompts."""

from __future__ import annotations

import pytest
import torch
from helpers import decoding_caller, make_model, make_tokenizer, toy_prompts

import hf_mars
from hf_mars.decoding.runner import serving_runner

MODES = {
    "tau=0.9": dict(mars_tau=0.9),
    "lossless": dict(mars_verify=True, mars_draft_candidates=2, mars_lookup=2),
    "sampled lossless": dict(mars_verify=True, do_sample=True, top_k=20),
}


@pytest.fixture(scope="module")
def model():
    tok = make_tokenizer()
    return hf_mars.to_mars(make_model("llama"), tok, block_size=4).eval(), tok


def _recording(model, calls: list):
    def record(module, args, kwargs):
        calls.append(decoding_caller(3))

    return model.register_forward_pre_hook(record, with_kwargs=True)


@pytest.mark.parametrize("cache", [{}, dict(cache_implementation="static")], ids=["no cache", "static"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("mode", MODES)
def test_generate_runs_every_pass_after_the_prompts_in_the_graph_pass(model, mode, rows, cache):
    model, tok = model
    enc = toy_prompts(tok, n=rows, seed=3)
    assert rows == 1 or bool((enc.attention_mask == 0).any()), "the premise: a ragged batch"
    calls = []
    handle = _recording(model, calls)
    try:
        torch.manual_seed(0)
        out = model.generate(
            **enc,
            max_new_tokens=24,
            min_new_tokens=24,
            return_dict_in_generate=True,
            **cache,
            **MODES[mode],
        )
    finally:
        handle.remove()
    assert len(calls) == out.mars_stats.forward_passes > 2
    assert calls[0] == "session.py:_forward" and set(calls[1:]) == {"graph.py:_forward"}, calls


@pytest.mark.parametrize("mode", MODES)
def test_a_cache_passed_in_is_continued_in_the_graph_pass(model, mode):
    """A conversation's second turn: `generate()` given the first turn's returned `DynamicCache` takes its K/V into the
    runner's cache (`_carry_prefix`); the rest of the prompt is the prompt's pass, every later pass the graph pass's,
    and the cache passed in is left as it was. Greedy lossless mode gives the tokens of plain `generate()` continuing
    the same cache."""
    import copy

    from transformers import GenerationMixin

    model, tok = model
    enc = toy_prompts(tok, n=3, seed=7)
    first = model.generate(**enc, max_new_tokens=8, min_new_tokens=8, mars_tau=1.0, return_dict_in_generate=True)
    ids = torch.cat([first.sequences, torch.full((3, 2), 7)], dim=1)
    mask = torch.cat([enc.attention_mask, torch.ones(3, ids.shape[1] - enc.input_ids.shape[1], dtype=torch.long)], 1)
    prefix = first.past_key_values
    held = [layer.keys.clone() for layer in prefix.layers]
    kwargs = dict(max_new_tokens=20, min_new_tokens=20, **MODES[mode])
    calls = []
    handle = _recording(model, calls)
    try:
        torch.manual_seed(0)
        out = model.generate(ids, attention_mask=mask, past_key_values=prefix, return_dict_in_generate=True, **kwargs)
    finally:
        handle.remove()
    assert len(calls) == out.mars_stats.forward_passes > 2
    assert calls[0] == "session.py:_forward" and set(calls[1:]) == {"graph.py:_forward"}, calls
    assert all(torch.equal(layer.keys, keys) for layer, keys in zip(prefix.layers, held))
    if kwargs.get("do_sample") or not kwargs.get("mars_verify"):
        return
    plain = GenerationMixin.generate(
        model, ids, attention_mask=mask, past_key_values=copy.deepcopy(prefix), do_sample=False, max_new_tokens=20
    )
    assert out.mars_stats.forward_passes < 20 and torch.equal(out.sequences, plain)


def test_a_servers_runner_runs_each_prompts_pass_then_every_other_in_the_graph_pass(model):
    """Requests joining a runner one after another while the others decode, as `hf-mars serve` admits them (its
    engine is checked the same way in tests/serving/test_server.py)."""
    model, tok = model
    enc = toy_prompts(tok, n=4, seed=5)
    prompts = [enc.input_ids[i, enc.attention_mask[i].bool()] for i in range(4)]
    calls, admitted, steps = [], 0, 0

    def opened(i):
        return model.mars_rows(prompts[i][None], labels=[i], budgets=[12 + 4 * i], max_new_tokens=24, mars_verify=True)

    handle = _recording(model, calls)
    try:
        with torch.inference_mode():
            runner = serving_runner(model, opened(0), 2, 128)
            waiting = list(range(4))
            while waiting or runner.live:
                if waiting and runner.room:
                    runner.admit(opened(waiting.pop(0)))
                    admitted += 1
                    assert calls[-1] == "session.py:_forward"
                if runner.live:
                    runner.step()
                    steps += 1
                    runner.release([label for label, _, done, _ in runner.rows() if done])
    finally:
        handle.remove()
    assert admitted == 4 and len(calls) == admitted + steps
    assert calls.count("session.py:_forward") == admitted
    assert set(calls) == {"session.py:_forward", "graph.py:_forward"}, calls


@pytest.mark.parametrize("mode", MODES)
def test_a_runner_of_its_own_decodes_as_generate_does(model, mode):
    """`model.mars_session` (the Space's route): the prompt's pass as it takes the rows, then every pass in the graph
    pass, stepped by its caller until each row stops; the tokens, the passes and what each pass accepted are
    `generate()`'s, the same seed drawing the same samples."""
    model, tok = model
    enc = toy_prompts(tok, n=2, seed=4)
    kwargs = dict(max_new_tokens=20, min_new_tokens=20, **MODES[mode])
    torch.manual_seed(0)
    out = model.generate(**enc, return_dict_in_generate=True, **kwargs)
    calls = []
    handle = _recording(model, calls)
    try:
        torch.manual_seed(0)
        runner = model.mars_session(**enc, log=True, **kwargs)
        while not all(done for _, _, done, _ in runner.rows()):
            runner.step()
    finally:
        handle.remove()
    rows = runner.rows()
    record = runner.record()
    assert len(calls) == record.forward_passes == out.mars_stats.forward_passes > 2
    assert calls[0] == "session.py:_forward" and set(calls[1:]) == {"graph.py:_forward"}, calls
    prompt = enc.input_ids.shape[1]
    assert [tokens for _, tokens, _, _ in rows] == out.sequences[:, prompt:].tolist()
    assert torch.equal(torch.stack(record.accepted_per_step), torch.stack(out.mars_stats.accepted_per_step))
    assert record.tau_per_step == out.mars_stats.tau_per_step


def test_a_logged_runner_records_more_passes_than_its_log_holds(model, monkeypatch):
    """A runner's log of accepted tokens has a row per cache slot; a logged runner that rows keep joining runs more
    passes than that, and its record keeps every one (the log is read, then written anew), each row still decoding as
    it would alone."""
    from hf_mars.decoding import generate as mars_generate

    model, tok = model
    monkeypatch.setattr(mars_generate, "DEFAULT_SLOTS_STEP", 1)  # a cache as small as the rows need
    enc = toy_prompts(tok, n=1, seed=6)
    kwargs = dict(max_new_tokens=16, min_new_tokens=16, mars_tau=1.0)
    alone = model.generate(**enc, **kwargs)[0, enc.input_ids.shape[1] :].tolist()
    runner = model.mars_session(**enc, log=True, labels=[0], **kwargs)
    finished = []
    while len(finished) < 8:
        runner.step()
        for label, tokens, done, _ in runner.rows():
            if done:
                finished.append(tokens)
                runner.release([label])
                if len(finished) < 8:
                    runner.admit(model.mars_rows(**enc, labels=[len(finished)], **kwargs))
    record = runner.record()
    assert record.forward_passes > runner.shape.slots, "the premise: more passes than the log has rows"
    assert len(record.accepted_per_step) == len(record.tau_per_step) == record.forward_passes
    assert finished == [alone] * 8
