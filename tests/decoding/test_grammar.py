"""Structured outputs (`hf_mars.grammar.GrammarProcessor`): a grammar constrains every slot of a MARS pass by its own
path, so lossless mode's text is plain constrained greedy decoding's and τ-mode's output is valid too."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
from helpers import make_model, toy_prompts

from hf_mars import to_mars
from hf_mars.grammar import GrammarProcessor

# Every output of this schema is at most a few dozen tokens (bounded strings and numbers, bounded whitespace): a
# budget past that ends every row at EOS, so the outputs must parse whatever the model's scores
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["answer", "count", "tags"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_pattern": "[ \\n]{0,2}"},  # a toy model writes whitespace while it may
}
BUDGET = 200


@pytest.fixture(scope="module")
def toy(trained_toy):
    model, tok = trained_toy
    return model.eval(), tok


def _decode(model, tok, enc, **kwargs) -> torch.Tensor:
    constrain = GrammarProcessor.from_json_schema(SCHEMA, tok, eos_token_id=model.generation_config.eos_token_id)
    out = model.generate(**enc, logits_processor=[constrain], max_new_tokens=BUDGET, do_sample=False, **kwargs)
    return out[:, enc["input_ids"].shape[1] :]


def _texts(tok, tokens: torch.Tensor) -> list[str]:
    return tok.batch_decode(tokens, skip_special_tokens=True)


def test_plain_constrained_decoding_writes_json_that_validates_and_stops(toy):
    model, tok = toy
    enc = toy_prompts(tok, n=3)
    tokens = _decode(model, tok, enc)
    eos = model.generation_config.eos_token_id
    for row, text in zip(tokens.tolist(), _texts(tok, tokens)):
        jsonschema.validate(json.loads(text), SCHEMA)
        assert eos in (row if isinstance(eos, int) else [eos]) or set(eos) & set(row)  # it ended, not ran out


def test_lossless_mode_under_a_grammar_is_plain_constrained_greedy_batched_and_alone(toy):
    model, tok = toy
    enc = toy_prompts(tok, n=3)
    plain = _decode(model, tok, enc)
    assert torch.equal(_decode(model, tok, enc, mars_verify=True), plain)
    assert torch.equal(_decode(model, tok, enc, mars_tau=1.0), plain)
    for row in range(3):  # each row alone, its own prompt unpadded
        real = enc["attention_mask"][row].bool()
        alone = {key: value[row : row + 1, real] for key, value in enc.items()}
        ours = _decode(model, tok, alone, mars_verify=True)[0]
        assert ours.tolist() == plain[row, : len(ours)].tolist()


def test_tau_mode_under_a_grammar_writes_json_that_validates(toy):
    model, tok = toy
    enc = toy_prompts(tok, n=3)
    out = model.generate(
        **enc,
        logits_processor=[GrammarProcessor.from_json_schema(SCHEMA, tok)],
        max_new_tokens=BUDGET,
        mars_tau=0.5,
        return_dict_in_generate=True,
    )
    texts = _texts(tok, out.sequences[:, enc["input_ids"].shape[1] :])
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert out.mars_stats.tokens_per_forward.max() > 1  # masks were taken under the grammar


def test_a_grammar_bars_tokens_by_each_rows_history_whatever_order_it_is_asked_in(tokenizer):
    """The processor keeps matchers for speed, but its scores depend on the history alone: histories asked in any
    order, going back and forth as MARS's slots do, get what a fresh processor gives each."""
    text = json.dumps({"answer": "maybe", "count": 42, "tags": ["ab", "c"]})
    ids = tokenizer(text, add_special_tokens=False).input_ids
    prompt, vocab = [1, 2, 3], 272
    lengths = list(range(len(ids) + 1)) * 2
    random.Random(0).shuffle(lengths)
    asked = [ids[:n] for n in lengths] + [ids[:9] + [ids[3]] * 4, ids[:20]]  # one the grammar refuses, then on
    kept = GrammarProcessor.from_json_schema(SCHEMA, tokenizer)
    kept(torch.tensor([prompt]), torch.zeros(1, vocab))  # its first call: the prompt, where generation starts
    barred = []
    for history in asked:
        fresh = GrammarProcessor.from_json_schema(SCHEMA, tokenizer)
        fresh(torch.tensor([prompt]), torch.zeros(1, vocab))
        row = torch.tensor([prompt + history])
        expected = fresh(row, torch.zeros(1, vocab))
        assert torch.equal(kept(row, torch.zeros(1, vocab)), expected)
        barred.append(int(expected.isinf().sum()))
    assert min(barred) == 0 < max(barred)  # the refused history keeps its scores; the others bar tokens


def test_a_schema_that_is_not_one_is_refused_by_name(tokenizer):
    with pytest.raises(ValueError, match="not JSON"):
        GrammarProcessor.from_json_schema("{not json", tokenizer)
    with pytest.raises(ValueError, match="JSON object"):
        GrammarProcessor.from_json_schema([1, 2], tokenizer)
    with pytest.raises(ValueError, match="Invalid grammar"):
        GrammarProcessor.from_json_schema({"type": "object", "properties": {"a": {"type": "no-such-type"}}}, tokenizer)


def test_a_random_model_under_a_grammar_decodes_losslessly():
    """Exactness does not need a good model: a random one's constrained greedy text, lossless."""
    from helpers import make_tokenizer

    tok = make_tokenizer()
    model = to_mars(make_model(), tok, block_size=4).eval()
    enc = toy_prompts(tok, n=2)
    plain = _decode(model, tok, enc)
    assert torch.equal(_decode(model, tok, enc, mars_verify=True), plain)
