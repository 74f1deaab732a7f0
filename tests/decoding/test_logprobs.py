"""The log probabilities of the tokens a runner decides (`Runner.logprobs`: what `hf-mars serve` answers `logprobs`
with): lossless mode's and τ = 1's are plain decoding's (the log-softmax of the processed scores `generate()` chose
from), batched or alone; τ-mode's are each slot's own, the model's own at the first token of every pass. The prompt's
pass records them as the runner admits the rows (`Session.logprobs`), every later pass in the graph pass (eager, a
grammar's rows too)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_model, make_tokenizer

import hf_mars
from hf_mars.decoding import verify
from hf_mars.decoding.runner import serving_runner
from hf_mars.grammar import GrammarProcessor

SCHEMA = {"type": "object", "properties": {"a": {"enum": ["yes", "no"]}, "b": {"type": "integer", "maximum": 99}}}
PROMPTS = ["hello world, how", "a", "the quick brown fox jumps"]
TOP = 3


@pytest.fixture(scope="module")
def model_and_tok():
    tok = make_tokenizer()
    model = make_model("llama", dtype=torch.float32)
    with torch.no_grad():  # confidences spread over (0, 1): passes accept one token or several
        model.lm_head.weight.mul_(4.0)
    return hf_mars.to_mars(model, tok, block_size=4).eval(), tok


def decoded(model, tok, prompts, max_new_tokens: int = 16, **mode) -> dict:
    """Each row's `(tokens, logprobs, top values, top ids, first of each pass)` from an eager runner that records them,
    built as a server builds one (its prompt's pass run by `admit`; a grammar's too, called on each slot's text)."""
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    labels = list(range(len(prompts)))
    session = model.mars_rows(**enc, do_sample=False, max_new_tokens=max_new_tokens, labels=labels, **mode)
    session.separate_prompts()
    session.logprobs = TOP
    rows = {i: ([], [], [], [], []) for i in range(len(prompts))}
    runs = serving_runner(model, session, len(prompts) + 1, 256)  # a row to spare: a server's free rows
    runs.admit(session)
    first = True
    while runs.live:
        if not first:
            runs.step()
        first = False
        fed, chosen, values, ids = runs.scored
        place = {row: p for p, row in enumerate(fed.tolist())}
        for i, (label, tokens, _, _) in enumerate(runs.rows()):  # i: the row's place in the batch
            kept = rows[label]
            new = tokens[len(kept[0]) :]
            if new:
                kept[4].append(len(kept[0]))
                kept[0].extend(new)
                for field, value in zip(kept[1:4], (chosen, values, ids)):
                    field.extend(value[place[i], : len(new)].tolist())
        gone = [label for label, _, done, _ in runs.rows() if done]
        if gone:
            runs.release(gone)
    return rows


def plain(model, tok, prompt: str, max_new_tokens: int = 16, **processing) -> tuple[list[int], torch.Tensor]:
    """`generate()`'s greedy tokens for the prompt alone and the log-softmax of the scores it chose them from."""
    ids = tok(prompt, return_tensors="pt")
    out = model.generate(
        **ids,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        output_scores=True,
        return_dict_in_generate=True,
        **processing,
    )
    logprobs = torch.stack(out.scores, dim=1)[0].float().log_softmax(dim=-1)
    return out.sequences[0, ids.input_ids.shape[1] :].tolist(), logprobs


@pytest.mark.parametrize(
    "mode", [{"mars_verify": True}, {"mars_tau": 1.0}, {"mars_verify": True, "mars_draft_candidates": [2, 2]}]
)
@pytest.mark.parametrize("processing", ["none", "penalties", "grammar"])
def test_lossless_and_tau_1_give_plain_decodings_log_probabilities_batched(model_and_tok, mode, processing):
    """After the request's processors: a repetition penalty and n-gram bans (MARS's own rules), a JSON grammar
    (transformers' call on each slot's text)."""
    model, tok = model_and_tok

    def processors() -> dict:
        if processing == "penalties":
            return {"repetition_penalty": 1.3, "no_repeat_ngram_size": 3}
        if processing == "grammar":
            eos = model.generation_config.eos_token_id
            return {"logits_processor": [GrammarProcessor.from_json_schema(SCHEMA, tok, eos_token_id=eos)]}
        return {}

    rows = decoded(model, tok, PROMPTS, **mode, **processors())
    for i, prompt in enumerate(PROMPTS):
        tokens, logprobs, values, ids, _ = rows[i]
        expected_tokens, expected = plain(model, tok, prompt, **processors())
        assert tokens == expected_tokens
        steps = torch.arange(len(tokens))
        assert logprobs == pytest.approx(expected[steps, torch.tensor(tokens)].tolist(), abs=1e-4)
        top = expected.topk(TOP, dim=-1)
        assert torch.allclose(torch.tensor(values), top.values, atol=1e-4)
        assert [row[0] for row in ids] == tokens  # greedy: the likeliest token, the one chosen


def test_tau_modes_log_probabilities_are_each_slots_own(model_and_tok):
    """τ = 0.6: a greedy slot's token is its likeliest, so its log probability is its top value; the first token of
    each pass is decided by the model's own prediction after the text so far (a forward over that text gives it);
    some pass takes masks' tokens (the premise: otherwise nothing here is τ-mode's own)."""
    model, tok = model_and_tok
    rows = decoded(model, tok, PROMPTS, mars_tau=0.6)
    took_masks = False
    for i, prompt in enumerate(PROMPTS):
        tokens, logprobs, values, _, firsts = rows[i]
        took_masks |= len(firsts) < len(tokens)
        assert logprobs == pytest.approx([v[0] for v in values], abs=1e-6)
        assert all(lp <= 0 for lp in logprobs)
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            text = torch.cat([ids, torch.tensor([tokens])], dim=1)
            own = model(text).logits[0, ids.shape[1] - 1 : -1].float().log_softmax(dim=-1)
        at = torch.tensor(firsts)
        assert [logprobs[f] for f in firsts] == pytest.approx(own[at, torch.tensor(tokens)[at]].tolist(), abs=1e-4)
    assert took_masks


def test_rows_that_ask_join_a_runner_that_did_not_and_get_their_own_from_then_on(model_and_tok):
    """A running runner records nothing; rows that ask for 2 alternatives join it: it records for every row from the
    next pass, as many as any row asked for, and the rows that joined get plain decoding's."""
    model, tok = model_and_tok
    tok.padding_side = "left"

    def prepared(prompts, labels, logprobs):
        enc = tok(prompts, return_tensors="pt", padding=True)
        session = model.mars_rows(
            **enc, do_sample=False, max_new_tokens=16, labels=labels, max_rows=3, mars_verify=True
        )
        session.separate_prompts()
        session.logprobs = logprobs
        return session

    first = prepared(PROMPTS[:2], ["a", "b"], None)
    running = serving_runner(model, first, 3, 256)
    running.admit(first)
    running.step()
    assert running.scored is None and running.logprobs is None
    running.admit(prepared(PROMPTS[2:], ["c"], 2))
    fed, chosen, _, _ = running.scored  # its prompt's pass: its first tokens'
    place = {row: p for p, row in enumerate(fed.tolist())}
    c = [label for label, _, _, _ in running.rows()].index("c")
    got = chosen[place[c], : len(running.rows()[c][1])].tolist()
    assert running.logprobs == 2
    while running.live:
        running.step()
        fed, chosen, values, _ = running.scored
        assert values.shape[-1] == 2
        place = {row: p for p, row in enumerate(fed.tolist())}
        for i, (label, tokens, _, _) in enumerate(running.rows()):
            if label == "c" and len(tokens) > len(got):
                got += chosen[place[i], : len(tokens) - len(got)].tolist()
        running.release([label for label, _, done, _ in running.rows() if done])
    tokens, expected = plain(model, tok, PROMPTS[2])
    assert got == pytest.approx(expected[torch.arange(len(tokens)), torch.tensor(tokens)].tolist(), abs=1e-4)


def test_a_token_kept_on_a_runner_up_is_scored_at_that_node(model_and_tok, monkeypatch):
    """Lossless mode with runner-ups: a token whose path runs through a runner-up draft is scored at that node's
    outputs, not at the chain's node of its depth. The premise, from the run itself: some pass kept a path that ends
    past the chain's nodes (`verify.deepest_kept`, which both the loop and the graph pass call)."""
    model, tok = model_and_tok
    ends, kept = [], verify.deepest_kept

    def spy(*args):
        out = kept(*args)
        ends.append(int(out[1].max()))
        return out

    monkeypatch.setattr(verify, "deepest_kept", spy)
    prompts = ["x y z", "12 13", "the the the", "once upon a time"]
    mode = {"mars_verify": True, "mars_draft_candidates": [2, 2]}
    rows = decoded(model, tok, prompts, max_new_tokens=32, **mode)
    assert max(ends) > model.generation_config.mars_block_size - 1  # nodes 1..B-1 are the chain's
    for i, prompt in enumerate(prompts):
        tokens, logprobs, _, _, _ = rows[i]
        expected_tokens, expected = plain(model, tok, prompt, max_new_tokens=32)
        assert tokens == expected_tokens
        assert logprobs == pytest.approx(expected[torch.arange(len(tokens)), torch.tensor(tokens)].tolist(), abs=1e-4)
