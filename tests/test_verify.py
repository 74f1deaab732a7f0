"""Lossless mode (`mars_verify=True`): drafts from the masks, verified by the model itself; output = greedy AR."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_tokenizer
from transformers import GenerationMixin

import hf_mars
from hf_mars.toy import counting_dataset


def toy_prompts(tok, n=8, seed=4321):
    test = counting_dataset(n, seed=seed)
    prompts = [tok.apply_chat_template(ex["messages"][:1], add_generation_prompt=True, tokenize=False) for ex in test]
    return tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)


def tokens_per_forward(stats):
    return stats.new_tokens.sum().item() / stats.passes_per_row.sum().item()


def test_lossless_equals_greedy_generate_at_every_tau_on_a_trained_model(trained_toy):
    model, tok = trained_toy
    enc = toy_prompts(tok)
    reference = GenerationMixin.generate(model, **enc, do_sample=False, max_new_tokens=60)
    speed = {}
    for tau in (1.0, 0.9, 0.7, 0.0):
        out = model.generate(**enc, mars_tau=tau, mars_verify=True, max_new_tokens=60, return_dict_in_generate=True)
        assert torch.equal(out.sequences, reference), f"tau={tau}"
        speed[tau] = tokens_per_forward(out.mars_stats)
    assert speed[1.0] == 1.0
    assert speed[0.7] > 1.15 and speed[0.0] > 1.15  # drafts get accepted: more than one token per pass, for free
    # τ-mode at the same τ accepts more, but its output may differ from AR; lossless mode never does
    fast = model.generate(**enc, mars_tau=0.0, max_new_tokens=60, return_dict_in_generate=True)
    assert tokens_per_forward(fast.mars_stats) > speed[0.0]


def test_lossless_rows_alone_equal_the_batch(trained_toy):
    model, tok = trained_toy
    enc = toy_prompts(tok, n=4, seed=77)
    batched = model.generate(**enc, mars_tau=0.5, mars_verify=True, max_new_tokens=50)
    for i in range(4):
        ids = enc.input_ids[i : i + 1, enc.attention_mask[i].bool()]
        alone = model.generate(input_ids=ids, mars_tau=0.5, mars_verify=True, max_new_tokens=50)[0, ids.shape[1] :]
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
            out = mars.generate(**enc, mars_tau=tau, mars_verify=True, max_new_tokens=30, **kwargs)
            assert torch.equal(out, reference), (tau, kwargs)


def test_lossless_streams_each_pass_and_refuses_sampling(trained_toy):
    from test_generation import Recorder

    model, tok = trained_toy
    enc = toy_prompts(tok, n=1)
    streamer = Recorder()
    out = model.generate(**enc, mars_tau=0.0, mars_verify=True, max_new_tokens=40, streamer=streamer, return_dict_in_generate=True)
    _, *chunks = streamer.chunks
    assert [len(c) for c in chunks] == [int(a) for a in out.mars_stats.accepted_per_step]
    assert sum(chunks, []) == out.sequences[0, enc.input_ids.shape[1] :].tolist()
    with pytest.raises(ValueError, match="greedy"):
        model.generate(**enc, mars_tau=0.5, mars_verify=True, do_sample=True, max_new_tokens=4)
