"""Stopping criteria under MARS see exactly what `generate()` shows them: the whole batch in its original order,
finished rows padded, each row its own tokens, one call per step. Stateful per-row criteria (lm-eval's
`MultiTokenEOSCriteria` is one) then stop every row where plain decoding stops it."""

from __future__ import annotations

import pytest
import torch
from helpers import StopRowAfterCalls, make_model, make_tokenizer
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_mars

PROMPTS = ["hello world, how", "a", "the quick brown fox jumps", "one two"]
MODES = {
    "tau=1": dict(mars_tau=1.0),
    "lossless chain": dict(mars_tau=0.0, mars_verify=True),
    "lossless tree": dict(mars_verify=True, mars_block_size=3, mars_draft_candidates=3, mars_lookup=4),
}


def models():
    """A MARS model whose head is sharpened (so τ < 1 accepts several tokens per pass) and the same weights as a
    plain model, whose `generate()` is the reference."""
    tok = make_tokenizer()
    mars = make_model("qwen2", dtype=torch.float64)
    with torch.no_grad():
        mars.lm_head.weight.mul_(4.0)
    mars = hf_mars.to_mars(mars, tok, block_size=4)
    plain = make_model("qwen2", dtype=torch.float64)
    plain.load_state_dict(mars.state_dict())
    return mars, plain, tok


class StopWhenAllSaw(StoppingCriteria):
    """lm-eval's `MultiTokenEOSCriteria` pattern: a per-row done tracker over the last tokens after the prompt, and
    one verdict for the whole batch (True once every row has seen its stop sequence)."""

    def __init__(self, stop: list[int], prompt_length: int, batch: int):
        self.stop, self.prompt_length, self.done = stop, prompt_length, [False] * batch

    def __call__(self, input_ids, scores, **kwargs):
        n = len(self.stop)
        tail = input_ids[:, self.prompt_length :][:, -(n + 2) :].tolist()  # a lookback a little longer than the stop
        for i, row in enumerate(tail):
            self.done[i] = self.done[i] or any(row[j : j + n] == self.stop for j in range(len(row) - n + 1))
        return all(self.done)


# An EOS criterion makes generate() pad the rows that finished (an id these models do not produce in 24 tokens);
# without one, a finished row goes on generating until the whole batch has finished.
NEVER = 271


def generate_both(mars, plain, enc, make_criterion, eos_token_id=NEVER, **mars_kwargs):
    kwargs = dict(max_new_tokens=24, eos_token_id=eos_token_id)
    ref_criterion = make_criterion()
    reference = plain.generate(
        **enc, do_sample=False, stopping_criteria=StoppingCriteriaList([ref_criterion]), **kwargs
    )
    criterion = make_criterion()
    out = mars.generate(
        **enc,
        stopping_criteria=StoppingCriteriaList([criterion]),
        return_dict_in_generate=True,
        **mars_kwargs,
        **kwargs,
    )
    return reference, ref_criterion, out, criterion


@pytest.mark.parametrize("eos", [NEVER, None], ids=["eos", "no-eos"])
@pytest.mark.parametrize("mode", MODES)
def test_stateful_per_row_criterion_stops_each_row_where_generate_does(mode, eos):
    mars, plain, tok = models()
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    reference, ref_criterion, out, criterion = generate_both(
        mars, plain, enc, lambda: StopRowAfterCalls([3, 7, 11, 15]), eos_token_id=eos, **MODES[mode]
    )
    assert torch.equal(out.sequences, reference)  # rows stop after 3, 7, 11 and 15 new tokens (padded with EOS)
    prompt = enc.input_ids.shape[1]
    assert out.mars_stats.new_tokens.tolist() == ([3, 7, 11, 15] if eos is not None else [15] * 4)
    # the very calls generate() makes: the whole batch, in order, one per step, finished rows padded
    assert len(criterion.seen) == len(ref_criterion.seen) == 15
    for got, expected in zip(criterion.seen, ref_criterion.seen):
        assert torch.equal(got, expected)
    assert reference.shape[1] == prompt + 15


def test_rows_running_ahead_are_held_to_generates_steps():
    """τ < 1 accepts several tokens per pass and rows run at different speeds: each call still shows step n of
    every row (the prompt and its first n tokens, in the batch's order), one call per step, no step twice."""
    mars, _, tok = models()
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    criterion = StopRowAfterCalls([3, 7, 11, 15])
    out = mars.generate(
        **enc,
        mars_tau=0.3,
        max_new_tokens=24,
        eos_token_id=NEVER,
        return_dict_in_generate=True,
        stopping_criteria=StoppingCriteriaList([criterion]),
    )
    assert max(out.mars_stats.accepted_per_step[0].tolist()) > 1  # several tokens in a pass
    assert len(set(torch.stack(out.mars_stats.accepted_per_step).sum(dim=0).tolist())) > 1  # rows at different speeds
    prompt = enc.input_ids.shape[1]
    assert out.mars_stats.new_tokens.tolist() == [3, 7, 11, 15]
    free = mars.generate(**enc, mars_tau=0.3, max_new_tokens=24, eos_token_id=NEVER)  # the same rows, not stopped
    for step, seen in enumerate(criterion.seen, start=1):
        assert seen.shape == (4, prompt + step)
        for row, limit in enumerate([3, 7, 11, 15]):
            expected = free[row, : prompt + step].clone()
            expected[prompt + limit :] = tok.pad_token_id  # a row stopped at an earlier step is padding since
            assert torch.equal(seen[row], expected), (step, row)


@pytest.mark.parametrize("mode", MODES)
def test_lm_eval_style_batch_criterion(mode):
    """One verdict for the batch from a per-row tracker, reading the tokens after the prompt (lm-eval's pattern)."""
    mars, plain, tok = models()
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    prompt = enc.input_ids.shape[1]
    free = plain.generate(**enc, do_sample=False, max_new_tokens=24, eos_token_id=None)[:, prompt:].tolist()
    common = set(free[0]).intersection(*free[1:])  # a token every row produces: the batch stops once all have
    stop = [min(common, key=lambda t: max(row.index(t) for row in free))]
    reference, _, out, _ = generate_both(mars, plain, enc, lambda: StopWhenAllSaw(stop, prompt, 4), **MODES[mode])
    assert reference.shape[1] < prompt + 24  # the criterion stopped the batch
    assert torch.equal(out.sequences, reference)


def test_batched_equals_unbatched_under_a_stop_string():
    mars, _, tok = models()
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    prompt = enc.input_ids.shape[1]
    free = mars.generate(**enc, mars_tau=0.5, max_new_tokens=24, eos_token_id=None)[:, prompt:]
    stop = tok.decode(free[1, 4:6])
    kwargs = dict(mars_tau=0.5, max_new_tokens=24, eos_token_id=None, stop_strings=stop, tokenizer=tok)
    batched = mars.generate(**enc, **kwargs)
    for i in range(len(PROMPTS)):
        ids = enc.input_ids[i : i + 1, enc.attention_mask[i].bool()]
        alone = mars.generate(input_ids=ids, **kwargs)[0, ids.shape[1] :].tolist()
        row = batched[i, prompt:].tolist()
        assert row[: len(alone)] == alone and all(t == tok.pad_token_id for t in row[len(alone) :])
