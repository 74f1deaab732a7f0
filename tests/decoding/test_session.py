"""`model.mars_session`: a runner of the caller's rows, which rows prepared by `model.mars_rows` join between passes
and which they leave, each decoding exactly as alone."""

from __future__ import annotations

import pytest
import torch
from helpers import make_model, make_tokenizer

import hf_mars

PROMPTS = ["hello world, how", "a", "the quick brown fox jumps", "count to ten"]
MODES = {"tau=1": {"mars_tau": 1.0}, "lossless": {"mars_verify": True}, "tau=0.6": {"mars_tau": 0.6}}


@pytest.fixture(scope="module")
def model_and_tok():
    tok = make_tokenizer()
    model = make_model("llama", dtype=torch.float64)
    with torch.no_grad():  # confidences spread over (0, 1): passes accept one token or several
        model.lm_head.weight.mul_(4.0)
    return hf_mars.to_mars(model, tok, block_size=4).eval(), tok


def alone(model, tok, prompt: str, max_new_tokens: int, **mode) -> list[int]:
    """`generate()`'s new tokens for this prompt alone."""
    ids = tok(prompt, return_tensors="pt")
    out = model.generate(**ids, do_sample=False, max_new_tokens=max_new_tokens, **mode)
    return out[0, ids.input_ids.shape[1] :].tolist()


CAPACITY = 4  # rows a runner holds, those that join later included


def open_rows(model, tok, prompts, labels, max_new_tokens=20, **mode):
    """A runner of `CAPACITY` rows over `prompts` (left-padded), after their prompt's pass."""
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    return model.mars_session(
        **enc, do_sample=False, max_new_tokens=max_new_tokens, labels=labels, capacity=CAPACITY, **mode
    )


def joining(model, tok, prompts, labels, max_new_tokens=20, separate=False, **mode):
    """`prompts` prepared to join a runner of `CAPACITY` rows (`separate`: each row a batch of its own)."""
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    rows = model.mars_rows(
        **enc, do_sample=False, max_new_tokens=max_new_tokens, labels=labels, max_rows=CAPACITY, **mode
    )
    if separate:
        rows.separate_prompts()
    return rows


def drain(runner, results: dict) -> None:
    """Step until every row stops, releasing each the pass it stops, as a server does."""
    while True:
        stopped = []
        for label, tokens, done, _ in runner.rows():
            if done:
                results[label] = tokens
                stopped.append(label)
        if stopped:
            runner.release(stopped)
        if not runner.live:
            return
        runner.step()


@pytest.mark.parametrize("mode", list(MODES))
def test_rows_admitted_mid_batch_equal_each_row_alone(model_and_tok, mode):
    model, tok = model_and_tok
    settings = MODES[mode]
    results = {}
    runner = open_rows(model, tok, PROMPTS[:2], labels=["a", "b"], **settings)
    for _ in range(3):
        runner.step()
    runner.admit(joining(model, tok, PROMPTS[2:], labels=["c", "d"], max_new_tokens=12, **settings))
    assert runner.labels == ["a", "b", "c", "d"]
    drain(runner, results)
    reference = {} if mode in ("tau=1", "lossless") else settings  # exact: plain greedy generate()'s tokens
    for label, prompt, budget in zip("abcd", PROMPTS, (20, 20, 12, 12)):
        assert results[label] == alone(model, tok, prompt, budget, **reference), (mode, label)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_row_that_longer_rows_join_stays_exact(model_and_tok, mode):
    """A row with a longer prompt joins a running row: its prompt ends just before the slot the next pass writes,
    which moves on past the running row's text (holes for it there), which every pass must hide from it, the
    one-token passes of τ = 1 too."""
    model, tok = model_and_tok
    settings = MODES[mode]
    short, long = "a", "the quick brown fox jumps"
    runner = open_rows(model, tok, [short], labels=["short"], **settings)
    runner.admit(joining(model, tok, [long], labels=["long"], **settings))
    results = {}
    drain(runner, results)
    reference = {} if mode in ("tau=1", "lossless") else settings  # exact: plain greedy generate()'s tokens
    for label, prompt in (("short", short), ("long", long)):
        assert results[label] == alone(model, tok, prompt, 20, **reference), (mode, label)


@pytest.mark.parametrize("mode", ["tau=1", "lossless"])
def test_a_minimum_of_new_tokens_counts_from_each_rows_prompt_as_longer_rows_join(model_and_tok, mode):
    """`min_new_tokens` counts from each row's own prompt, whatever rows join it: each row is held to its own
    minimum, as alone."""
    model, tok = model_and_tok
    short, long = "a", "the quick brown fox jumps"
    stop = alone(model, tok, short, 20)[3]  # a token the short row decodes soon: its EOS here
    free = alone(model, tok, short, 20, eos_token_id=stop)
    assert len(free) <= 4, "the premise: alone, the short row stops early"
    minimum = len(free) + 3
    settings = dict(MODES[mode], eos_token_id=stop, min_new_tokens=minimum)
    runner = open_rows(model, tok, [short], labels=["short"], **settings)
    runner.admit(joining(model, tok, [long], labels=["long"], **settings))
    results = {}
    drain(runner, results)
    for label, prompt in (("short", short), ("long", long)):
        assert results[label] == alone(model, tok, prompt, 20, eos_token_id=stop, min_new_tokens=minimum), label
    assert len(results["short"]) > len(free)


BANS = {"": {}, "no_repeat_ngram": dict(no_repeat_ngram_size=4), "bad words": dict(bad_words_ids=[[5, 6]])}


@pytest.mark.parametrize("together", [False, True], ids=["joined", "opened together"])
@pytest.mark.parametrize("ban", BANS)
@pytest.mark.parametrize("mode", ["tau=1", "lossless"])
def test_a_minimum_length_counts_each_rows_prompt_as_its_own_batch_padded_it(model_and_tok, mode, ban, together):
    """`min_length` counts the prompt, padding included, as `generate()` does; the padding of rows prepared with a
    longer prompt is not the row's own when `separate_prompts` makes each a batch of its own (as a server's requests):
    each row is held to its own minimum, as alone. With an n-gram ban, MARS's rules score each slot's text; with a bad
    word of two tokens, transformers' processors do (called on each slot's text): the minimum still by each row's own
    length."""
    model, tok = model_and_tok
    short, long = "a", "the quick brown fox jumps"
    stop = alone(model, tok, short, 20)[3]  # a token the short row decodes soon: its EOS here
    free = alone(model, tok, short, 20, eos_token_id=stop)
    assert len(free) <= 4, "the premise: alone, the short row stops early"
    rules = dict(eos_token_id=stop, min_length=len(tok(short).input_ids) + len(free) + 3, **BANS[ban])
    if together:
        rows = joining(model, tok, [short, long], ["short", "long"], separate=True, **MODES[mode], **rules)
        runner = open_rows(model, tok, [short], labels=["first"], **MODES[mode], **rules)
        runner.release(["first"])
        runner.admit(rows)
    else:
        runner = open_rows(model, tok, [short], labels=["short"], **MODES[mode], **rules)
        runner.admit(joining(model, tok, [long], labels=["long"], **MODES[mode], **rules))
    results = {}
    drain(runner, results)
    for label, prompt in (("short", short), ("long", long)):
        assert results[label] == alone(model, tok, prompt, 20, **rules), label
    assert len(results["short"]) > len(free)


@pytest.mark.parametrize("mode", ["tau=1", "lossless"])
def test_rows_with_a_repetition_penalty_join_and_leave_exactly(model_and_tok, mode):
    """`generate()` tells a repetition penalty each row's left padding; rows that join and leave keep theirs: every
    row gets `generate()`'s penalised tokens for its prompt alone."""
    model, tok = model_and_tok
    settings = dict(MODES[mode], repetition_penalty=1.3)
    results = {}
    runner = open_rows(model, tok, PROMPTS[:2], labels=["a", "b"], **settings)
    runner.step()
    runner.admit(joining(model, tok, PROMPTS[2:], labels=["c", "d"], max_new_tokens=12, **settings))
    drain(runner, results)
    for label, prompt, budget in zip("abcd", PROMPTS, (20, 20, 12, 12)):
        assert results[label] == alone(model, tok, prompt, budget, repetition_penalty=1.3), label
    assert alone(model, tok, PROMPTS[0], 20, repetition_penalty=1.3) != alone(model, tok, PROMPTS[0], 20)


def test_a_released_row_leaves_and_the_others_go_on_exactly(model_and_tok):
    model, tok = model_and_tok
    runner = open_rows(model, tok, PROMPTS[:3], labels=[0, 1, 2], max_new_tokens=16, mars_tau=0.6)
    runner.step()
    runner.release([1])
    assert runner.labels == [0, 2] and runner.decoding == 2
    results = {}
    drain(runner, results)
    assert set(results) == {0, 2}
    for label in (0, 2):
        assert results[label] == alone(model, tok, PROMPTS[label], 16, mars_tau=0.6)


def test_each_row_keeps_its_own_budget(model_and_tok):
    model, tok = model_and_tok
    tok.padding_side = "left"
    enc = tok(PROMPTS[:2], return_tensors="pt", padding=True)
    runner = model.mars_session(**enc, do_sample=False, max_new_tokens=20, budgets=[5, 20], mars_verify=True)
    results = {}
    drain(runner, results)
    assert results[0] == alone(model, tok, PROMPTS[0], 5)
    assert results[1] == alone(model, tok, PROMPTS[1], 20)


def test_what_a_runner_cannot_do_is_refused_by_name(model_and_tok):
    model, tok = model_and_tok
    ids = tok(PROMPTS[:1], return_tensors="pt").input_ids
    with pytest.raises(ValueError, match="stop_strings"):
        model.mars_session(ids, stop_strings=["."], mars_tau=0.9, max_new_tokens=8)
    with pytest.raises(ValueError, match="labels"):
        model.mars_session(ids, labels=["x", "y"], mars_tau=0.9, max_new_tokens=8)
    with pytest.raises(TypeError, match="capacity"):  # `mars_rows`' name for it
        model.mars_session(ids, max_rows=4, mars_tau=0.9, max_new_tokens=8)
    running = open_rows(model, tok, PROMPTS[:1], labels=[0], mars_tau=0.9)
    with pytest.raises(ValueError, match="other settings"):
        running.admit(joining(model, tok, PROMPTS[1:2], labels=[1], mars_tau=0.5))
    penalised = open_rows(model, tok, PROMPTS[:1], labels=[0], mars_tau=0.9, repetition_penalty=1.3)
    with pytest.raises(ValueError, match="other settings"):  # one penalty would decode both
        penalised.admit(joining(model, tok, PROMPTS[1:2], labels=[1], mars_tau=0.9, repetition_penalty=3.0))
    with pytest.raises(ValueError, match="cache slots"):  # the runner's cache is sized for its first rows
        running.admit(joining(model, tok, PROMPTS[1:2], labels=[1], max_new_tokens=400, mars_tau=0.9))
    with pytest.raises(ValueError, match="4D attention masks"):
        model.config._attn_implementation, attention = "flash_attention_2", model.config._attn_implementation
        try:
            model.mars_session(ids, mars_tau=0.9, max_new_tokens=8)
        finally:
            model.config._attn_implementation = attention


def test_a_logged_runner_records_every_pass_as_generate_does(model_and_tok):
    """`log=True` (the Space's): the runner's record holds what `generate()`'s `mars_stats` holds, pass for pass; a
    runner without it keeps none."""
    model, tok = model_and_tok
    ids = tok(PROMPTS[0], return_tensors="pt")
    out = model.generate(**ids, do_sample=False, max_new_tokens=16, mars_tau=0.6, return_dict_in_generate=True)
    runner = model.mars_session(ids.input_ids, do_sample=False, max_new_tokens=16, mars_tau=0.6, log=True)
    quiet = model.mars_session(ids.input_ids, do_sample=False, max_new_tokens=16, mars_tau=0.6)
    while not runner.rows()[0][2]:
        runner.step()
        quiet.step()
    (_, tokens, _, _), expected = runner.rows()[0], out.mars_stats
    assert tokens == out.sequences[0, ids.input_ids.shape[1] :].tolist()
    stats = runner.record()
    assert stats.forward_passes == expected.forward_passes > 1
    assert [int(a[0]) for a in stats.accepted_per_step] == [int(a[0]) for a in expected.accepted_per_step]
    assert stats.tau_per_step == expected.tau_per_step and stats.masks_per_step == expected.masks_per_step
    assert quiet.record() is None
