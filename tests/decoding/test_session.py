"""`model.mars_session`: rows that join a running batch between passes, and leave it, decode exactly as alone."""

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


def open_rows(model, tok, prompts, labels, max_new_tokens=20, separate=False, **mode):
    """A session over `prompts` (left-padded), after its first pass (`separate`: each row a batch of its own)."""
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    session = model.mars_session(
        enc.input_ids,
        attention_mask=enc.attention_mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        labels=labels,
        **mode,
    )
    if separate:
        session.separate_prompts()
    session.step(model)
    return session


def drain(model, session, results: dict) -> None:
    """Step until every row stops, releasing each the pass it stops, as a server does."""
    while True:
        stopped = []
        for label, tokens, done, _ in session.rows():
            if done:
                results[label] = tokens
                stopped.append(label)
        if stopped:
            session.release(stopped)
        if not session.live:
            return
        session.step(model)


@pytest.mark.parametrize("mode", list(MODES))
def test_rows_admitted_mid_batch_equal_each_row_alone(model_and_tok, mode):
    model, tok = model_and_tok
    settings = MODES[mode]
    results = {}
    session = open_rows(model, tok, PROMPTS[:2], labels=["a", "b"], **settings)
    for _ in range(3):
        session.step(model)
    late = open_rows(model, tok, PROMPTS[2:], labels=["c", "d"], max_new_tokens=12, **settings)
    session.admit(late)
    assert session.labels == ["a", "b", "c", "d"]
    drain(model, session, results)
    reference = {} if mode in ("tau=1", "lossless") else settings  # exact: plain greedy generate()'s tokens
    for label, prompt, budget in zip("abcd", PROMPTS, (20, 20, 12, 12)):
        assert results[label] == alone(model, tok, prompt, budget, **reference), (mode, label)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_row_that_longer_rows_join_stays_exact(model_and_tok, mode):
    """Rows with more cached slots join a running row with none of its own holes: the running row's cache is padded
    on its left with holes, which every pass must hide from it, the one-token passes of τ = 1 too (where the model
    builds the mask from the 2D slot map: one that says "no holes" lets it attend to them)."""
    model, tok = model_and_tok
    settings = MODES[mode]
    short, long = "a", "the quick brown fox jumps"
    session = open_rows(model, tok, [short], labels=["short"], **settings)
    session.admit(open_rows(model, tok, [long], labels=["long"], **settings))
    results = {}
    drain(model, session, results)
    reference = {} if mode in ("tau=1", "lossless") else settings  # exact: plain greedy generate()'s tokens
    for label, prompt in (("short", short), ("long", long)):
        assert results[label] == alone(model, tok, prompt, 20, **reference), (mode, label)


@pytest.mark.parametrize("mode", ["tau=1", "lossless"])
def test_a_minimum_of_new_tokens_counts_from_each_rows_prompt_as_longer_rows_join(model_and_tok, mode):
    """`min_new_tokens` counts from the column the prompts end at, which moves when a longer prompt joins (the
    prompts are padded anew): each row is held to its own minimum, as alone."""
    model, tok = model_and_tok
    short, long = "a", "the quick brown fox jumps"
    stop = alone(model, tok, short, 20)[3]  # a token the short row decodes soon: its EOS here
    free = alone(model, tok, short, 20, eos_token_id=stop)
    assert len(free) <= 4, "the premise: alone, the short row stops early"
    minimum = len(free) + 3
    settings = dict(MODES[mode], eos_token_id=stop, min_new_tokens=minimum)
    session = open_rows(model, tok, [short], labels=["short"], **settings)
    session.admit(open_rows(model, tok, [long], labels=["long"], **settings))
    results = {}
    drain(model, session, results)
    for label, prompt in (("short", short), ("long", long)):
        assert results[label] == alone(model, tok, prompt, 20, eos_token_id=stop, min_new_tokens=minimum), label
    assert len(results["short"]) > len(free)


BANS = {"": {}, "no_repeat_ngram": dict(no_repeat_ngram_size=4), "bad words": dict(bad_words_ids=[[5, 6]])}


@pytest.mark.parametrize("together", [False, True], ids=["joined", "opened together"])
@pytest.mark.parametrize("ban", BANS)
@pytest.mark.parametrize("mode", ["tau=1", "lossless"])
def test_a_minimum_length_counts_each_rows_prompt_as_its_own_batch_padded_it(model_and_tok, mode, ban, together):
    """`min_length` counts the prompt, padding included, as `generate()` does; the padding that a longer prompt's
    joining adds is not the row's: each row is held to its own minimum, as alone. Rows opened together are one
    batch, as in `generate()`, unless `separate_prompts` makes each its own (as a server's requests). With an n-gram
    ban, MARS's rules score each slot's text; with a bad word of two tokens, transformers' processors do (the loop's
    path for the processors only transformers applies): the minimum still by each row's own length."""
    model, tok = model_and_tok
    short, long = "a", "the quick brown fox jumps"
    stop = alone(model, tok, short, 20)[3]  # a token the short row decodes soon: its EOS here
    free = alone(model, tok, short, 20, eos_token_id=stop)
    assert len(free) <= 4, "the premise: alone, the short row stops early"
    rules = dict(eos_token_id=stop, min_length=len(tok(short).input_ids) + len(free) + 3, **BANS[ban])
    if together:
        session = open_rows(model, tok, [short, long], ["short", "long"], separate=True, **MODES[mode], **rules)
    else:
        session = open_rows(model, tok, [short], labels=["short"], **MODES[mode], **rules)
        session.admit(open_rows(model, tok, [long], labels=["long"], **MODES[mode], **rules))
    results = {}
    drain(model, session, results)
    for label, prompt in (("short", short), ("long", long)):
        assert results[label] == alone(model, tok, prompt, 20, **rules), label
    assert len(results["short"]) > len(free)


@pytest.mark.parametrize("mode", ["tau=1", "lossless"])
def test_rows_with_a_repetition_penalty_join_and_leave_exactly(model_and_tok, mode):
    """`generate()` tells a repetition penalty each row's left padding; rows that join (padded anew) and leave keep
    theirs: every row gets `generate()`'s penalised tokens for its prompt alone."""
    model, tok = model_and_tok
    settings = dict(MODES[mode], repetition_penalty=1.3)
    results = {}
    session = open_rows(model, tok, PROMPTS[:2], labels=["a", "b"], **settings)
    session.step(model)
    late = open_rows(model, tok, PROMPTS[2:], labels=["c", "d"], max_new_tokens=12, **settings)
    session.admit(late)
    drain(model, session, results)
    for label, prompt, budget in zip("abcd", PROMPTS, (20, 20, 12, 12)):
        assert results[label] == alone(model, tok, prompt, budget, repetition_penalty=1.3), label
    assert alone(model, tok, PROMPTS[0], 20, repetition_penalty=1.3) != alone(model, tok, PROMPTS[0], 20)


def test_a_released_row_leaves_and_the_others_go_on_exactly(model_and_tok):
    model, tok = model_and_tok
    session = open_rows(model, tok, PROMPTS[:3], labels=[0, 1, 2], max_new_tokens=16, mars_tau=0.6)
    session.step(model)
    session.release([1])
    assert session.labels == [0, 2] and session.text.sequences.shape[0] == 2
    results = {}
    drain(model, session, results)
    assert set(results) == {0, 2}
    for label in (0, 2):
        assert results[label] == alone(model, tok, PROMPTS[label], 16, mars_tau=0.6)


def test_each_row_keeps_its_own_budget(model_and_tok):
    model, tok = model_and_tok
    tok.padding_side = "left"
    enc = tok(PROMPTS[:2], return_tensors="pt", padding=True)
    session = model.mars_session(
        enc.input_ids,
        attention_mask=enc.attention_mask,
        do_sample=False,
        max_new_tokens=20,
        budgets=[5, 20],
        mars_verify=True,
    )
    session.step(model)
    results = {}
    drain(model, session, results)
    assert results[0] == alone(model, tok, PROMPTS[0], 5)
    assert results[1] == alone(model, tok, PROMPTS[1], 20)


def test_what_a_session_cannot_do_is_refused_by_name(model_and_tok):
    model, tok = model_and_tok
    ids = tok(PROMPTS[:1], return_tensors="pt").input_ids
    with pytest.raises(ValueError, match="stop_strings"):
        model.mars_session(ids, stop_strings=["."], mars_tau=0.9, max_new_tokens=8)
    with pytest.raises(ValueError, match="labels"):
        model.mars_session(ids, labels=["x", "y"], mars_tau=0.9, max_new_tokens=8)
    running = open_rows(model, tok, PROMPTS[:1], labels=[0], mars_tau=0.9)
    other = open_rows(model, tok, PROMPTS[1:2], labels=[1], mars_tau=0.5)
    with pytest.raises(ValueError, match="other settings"):
        running.admit(other)
    penalised = open_rows(model, tok, PROMPTS[:1], labels=[0], mars_tau=0.9, repetition_penalty=1.3)
    harder = open_rows(model, tok, PROMPTS[1:2], labels=[1], mars_tau=0.9, repetition_penalty=3.0)
    with pytest.raises(ValueError, match="other logits processors"):  # one penalty would decode both
        penalised.admit(harder)
    static = model.mars_session(ids, mars_tau=0.9, cache_implementation="static", max_new_tokens=8)
    static.step(model)
    with pytest.raises(ValueError, match="static cache"):
        running.admit(static)


def test_a_lossless_session_changes_its_draft_tree_between_passes_and_stays_exact(model_and_tok):
    """As a server re-chooses the tree for the rows it runs: a chain, a wide tree with runner-ups and lookup (more
    room than the session was opened with), plain decoding (no tree), a chain again, with rows joining on the way:
    every row keeps greedy `generate()`'s tokens."""
    from hf_mars.decoding.generate import session_settings

    model, tok = model_and_tok
    trees = [
        dict(mars_verify=True, mars_block_size=4, mars_draft_candidates=[3, 2], mars_lookup=3),
        dict(mars_verify=True, mars_block_size=2),
        dict(mars_tau=1.0),  # what lossless "auto" runs where no tree pays
        dict(mars_verify=True, mars_block_size=3),
    ]
    session = open_rows(model, tok, PROMPTS[:2], labels=["a", "b"], mars_verify=True, mars_block_size=2)
    results = {}
    for number, tree in enumerate(trees):
        settings = session_settings(model, None, 4, **tree)
        session.retree(settings)
        assert session.plan.settings == settings and session.plan.mode.__name__ == (
            "LosslessMode" if settings.verify else "TauMode"
        )
        for _ in range(2):
            session.step(model)
        if number == 1:
            late = open_rows(model, tok, PROMPTS[2:], labels=["c", "d"], max_new_tokens=12, **settings.as_kwargs())
            session.admit(late)
    drain(model, session, results)
    for label, prompt, budget in zip("abcd", PROMPTS, (20, 20, 12, 12)):
        assert results[label] == alone(model, tok, prompt, budget), label
    ids = tok(PROMPTS[:1], return_tensors="pt").input_ids
    static = model.mars_session(ids, mars_verify=True, cache_implementation="static", max_new_tokens=8)
    with pytest.raises(ValueError, match="keeps its draft tree"):
        static.retree(session_settings(model, None, 1, mars_verify=True, mars_block_size=3))


def test_a_logged_session_records_every_pass_as_generate_does(model_and_tok):
    """`log=True` (the Space's): the session's stats hold what `generate()`'s `mars_stats` holds, pass for pass; a
    session without it keeps none."""
    model, tok = model_and_tok
    ids = tok(PROMPTS[0], return_tensors="pt")
    out = model.generate(**ids, do_sample=False, max_new_tokens=16, mars_tau=0.6, return_dict_in_generate=True)
    session = model.mars_session(ids.input_ids, do_sample=False, max_new_tokens=16, mars_tau=0.6, log=True)
    quiet = model.mars_session(ids.input_ids, do_sample=False, max_new_tokens=16, mars_tau=0.6)
    with torch.no_grad():
        while session.live:
            session.step(model)
            quiet.step(model)
    (_, tokens, _, _), expected = session.rows()[0], out.mars_stats
    assert tokens == out.sequences[0, ids.input_ids.shape[1] :].tolist()
    assert session.stats.forward_passes == expected.forward_passes > 1
    assert [int(a[0]) for a in session.stats.accepted_per_step] == [int(a[0]) for a in expected.accepted_per_step]
    stats = session.stats
    assert stats.tau_per_step == expected.tau_per_step and stats.masks_per_step == expected.masks_per_step
    assert quiet.stats.forward_passes == expected.forward_passes and not quiet.stats.accepted_per_step
