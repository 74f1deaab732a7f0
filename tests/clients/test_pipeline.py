"""`transformers.pipeline("text-generation")` on a MARS checkpoint, unchanged: MARS settings go in as generate kwargs.

τ = 1 and lossless mode (`mars_verify=True`) must give the pipeline's plain greedy text; τ = 0.9 must reach the
decoder (the same text as `model.generate(mars_tau=0.9)` on the same inputs, in fewer forward passes than greedy).
"""

from __future__ import annotations

import pytest
import torch
from transformers import pipeline

PROMPT = "Count from 3 to 9."
PROMPTS = [PROMPT, "Repeat cat 5 times.", "Hi", "Write the letters from a to f."]
NEW = 16


@pytest.fixture(scope="module")
def generator(client_checkpoint):
    return pipeline("text-generation", model=str(client_checkpoint), trust_remote_code=True)


@pytest.fixture(scope="module")
def passes(generator):
    calls = [0]

    def hook(*_):
        calls[0] += 1

    generator.model.register_forward_pre_hook(hook)
    return calls


def run(generator, passes, inputs, **kwargs):
    passes[0] = 0
    out = generator(inputs, max_new_tokens=NEW, do_sample=False, **kwargs)
    return out, passes[0]


def direct(generator, prompts, **kwargs):
    """What `model.generate` itself returns for `prompts` as one left-padded batch (the generated text only)."""
    tok = generator.tokenizer
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = generator.model.generate(**enc, max_new_tokens=NEW, do_sample=False, **kwargs)
    return tok.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)


def test_pipeline_is_the_mars_model(generator):
    assert type(generator.model).__name__.startswith("MARS")
    assert generator.tokenizer.pad_token is not None and generator.tokenizer.padding_side == "left"


@pytest.mark.parametrize("kwargs", [{"mars_tau": 1.0}, {"mars_verify": True}], ids=["tau1", "verify"])
def test_string_matches_greedy(generator, passes, kwargs):
    plain, _ = run(generator, passes, PROMPT)
    mars, _ = run(generator, passes, PROMPT, **kwargs)
    assert plain[0]["generated_text"].startswith(PROMPT) and len(plain[0]["generated_text"]) > len(PROMPT)
    assert mars == plain


def test_string_tau_09(generator, passes):
    plain, plain_passes = run(generator, passes, PROMPT)
    mars, mars_passes = run(generator, passes, PROMPT, mars_tau=0.9)
    text = mars[0]["generated_text"]
    assert text.startswith(PROMPT)
    assert text[len(PROMPT) :] == direct(generator, [PROMPT], mars_tau=0.9)[0]
    assert mars_passes < plain_passes == NEW  # several tokens accepted in some passes


@pytest.mark.parametrize("kwargs", [{"mars_tau": 1.0}, {"mars_verify": True}], ids=["tau1", "verify"])
def test_batch_matches_greedy(generator, passes, kwargs):
    plain, _ = run(generator, passes, PROMPTS, batch_size=2, return_full_text=False)
    mars, _ = run(generator, passes, PROMPTS, batch_size=2, return_full_text=False, **kwargs)
    assert len(plain) == len(PROMPTS) and all(len(r) == 1 and r[0]["generated_text"] for r in plain)
    assert mars == plain


def test_batch_tau_09(generator, passes):
    plain, plain_passes = run(generator, passes, PROMPTS, batch_size=2, return_full_text=False)
    mars, mars_passes = run(generator, passes, PROMPTS, batch_size=2, return_full_text=False, mars_tau=0.9)
    texts = [r[0]["generated_text"] for r in mars]
    # The pipeline runs the prompts two by two; each pair decodes as model.generate decodes that pair.
    assert texts == direct(generator, PROMPTS[:2], mars_tau=0.9) + direct(generator, PROMPTS[2:], mars_tau=0.9)
    assert texts != [r[0]["generated_text"] for r in plain]
    assert mars_passes < plain_passes
