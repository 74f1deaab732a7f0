"""`TextIteratorStreamer` with MARS, as the transformers docs use it: `generate` in a thread, text read as it comes.

A MARS pass may hand the streamer several tokens at once; the streamed text must still be exactly the decoded
output of that same `generate` call."""

from __future__ import annotations

from threading import Thread

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer

NEW = 24


@pytest.fixture(scope="module")
def loaded(client_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(client_checkpoint, trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(client_checkpoint)
    calls = [0]

    def hook(*_):
        calls[0] += 1

    model.register_forward_pre_hook(hook)
    return model, tok, calls


def stream(model, tok, calls, **kwargs):
    """(streamed chunks, decoded output of the same call, forward passes)."""
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Count from 3 to 9."}], add_generation_prompt=True, tokenize=False
    )
    inputs = tok(text, return_tensors="pt", add_special_tokens=False)
    streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=120)
    result = {}

    def target():
        with torch.no_grad():
            result["out"] = model.generate(**inputs, streamer=streamer, max_new_tokens=NEW, do_sample=False, **kwargs)

    calls[0] = 0
    thread = Thread(target=target)
    thread.start()
    chunks = list(streamer)
    thread.join()
    decoded = tok.decode(result["out"][0, inputs.input_ids.shape[1] :])
    return chunks, decoded, calls[0]


@pytest.mark.parametrize("kwargs", [{"mars_tau": 0.9}, {"mars_verify": True}], ids=["tau09", "verify"])
def test_streamed_text_is_the_output(loaded, kwargs):
    chunks, decoded, passes = stream(*loaded, **kwargs)
    assert len(chunks) > 1  # text arrives as it is generated, not at the end only
    assert "".join(chunks) == decoded and decoded
    if kwargs.get("mars_tau") == 0.9:
        assert passes < NEW  # some passes accepted several tokens, and the streamer got them all


def test_lossless_stream_is_greedy_stream(loaded):
    greedy, greedy_decoded, _ = stream(*loaded)
    lossless, _, _ = stream(*loaded, mars_verify=True)
    assert "".join(lossless) == "".join(greedy) == greedy_decoded
