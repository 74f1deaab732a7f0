"""The `generate()` contract for MARS settings: one precedence wherever a setting is held (keyword, the call's
`GenerationConfig`, `model.generation_config`), strict values, refusals by name, and the cache returned as
`generate()` returns it."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import make_model, make_tokenizer
from transformers import GenerationConfig, GenerationMixin, LogitsProcessor, LogitsProcessorList

import hf_mars
from hf_mars.decoding.compat import CACHE_ARG
from hf_mars.decoding.settings import SETTING_KEYS

PROMPTS = ["hello world, how", "a", "the quick brown fox jumps"]
# A value of each setting that differs from its default, and one that differs from both
VALUES = {
    "mars_tau": (0.7, 0.4),
    "mars_block_size": (3, 2),
    "mars_confidence": ("margin", "entropy"),
    "mars_draft_candidates": (2, 3),
    "mars_lookup": (2, 5),
    "mars_mask_cost": (0.1, 0.3),
}
LOSSLESS_ONLY = ("mars_draft_candidates", "mars_lookup")


@pytest.fixture(scope="module")
def model_tok():
    tok = make_tokenizer()
    model = make_model("llama", dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # confidences spread over (0, 1)
    return hf_mars.to_mars(model, tok, block_size=4), tok


@pytest.fixture
def model(model_tok):
    model, _ = model_tok
    saved = copy.deepcopy(model.generation_config)
    yield model
    model.generation_config = saved


@pytest.fixture(scope="module")
def enc(model_tok):
    return model_tok[1](PROMPTS, return_tensors="pt", padding=True)


def greedy(model, enc, max_new_tokens=16, **kwargs):
    return GenerationMixin.generate(model, **enc, do_sample=False, max_new_tokens=max_new_tokens, **kwargs)


@pytest.mark.parametrize("key", sorted(VALUES))
def test_each_setting_reads_alike_from_keyword_call_config_and_model_config(model, key):
    first, second = VALUES[key]
    base = dict(mars_verify=True)  # lossless mode reads every setting

    def resolved(generation_config=None, **kwargs):
        return model.mars_settings(generation_config, **{**base, **kwargs})[key]

    default = resolved()
    assert default not in (first, second)
    setattr(model.generation_config, key, first)
    assert resolved() == first  # model.generation_config
    assert resolved(GenerationConfig(**{key: second})) == second  # the call's config beats the model's
    assert resolved(GenerationConfig(**{key: second}), **{key: first}) == first  # the keyword beats both
    assert resolved(GenerationConfig()) == first  # a config that leaves it unset falls back to the model's


def test_mars_verify_held_in_a_generation_config_runs_lossless_mode(model, enc):
    reference = greedy(model, enc)
    call_config = GenerationConfig(mars_verify=True, max_new_tokens=16, do_sample=False)
    for out in (
        model.generate(**enc, generation_config=call_config, return_dict_in_generate=True),
        model.generate(**enc, generation_config=call_config, mars_tau=0.0, return_dict_in_generate=True),
    ):
        assert torch.equal(out.sequences, reference)
        assert out.mars_stats is not None
        assert model.mars_settings(call_config)["mars_verify"] is True
    model.generation_config.mars_verify = True
    out = model.generate(**enc, mars_tau=0.0, max_new_tokens=16, return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference) and out.mars_stats.mean_tokens_per_forward > 1.0
    assert model.mars_settings()["mars_verify"] is True
    # An explicit keyword beats the configs: τ-mode at 0, which changes the text of this untrained model
    tau_mode = model.generate(**enc, mars_tau=0.0, mars_verify=False, max_new_tokens=16)
    assert model.mars_settings(mars_tau=0.0, mars_verify=False)["mars_verify"] is False
    assert not torch.equal(tau_mode, reference)


@pytest.mark.parametrize(
    "asked", [dict(mars_tau=0.6), dict(mars_verify=True, mars_lookup=2, mars_block_size=3)], ids=["tau", "lossless"]
)
def test_resolved_settings_are_keywords_that_decode_as_the_call_they_came_from(model, enc, asked):
    """`model.mars_settings(...)` is what `generate()` runs with, written as its keywords: passed back, they decode
    the same tokens (a server admits rows with the running rows' settings so); other `mars_*` names are refused."""
    settings = model.mars_settings(batch_size=len(PROMPTS), **asked)
    assert not set(settings) - set(SETTING_KEYS)
    expected = model.generate(**enc, do_sample=False, max_new_tokens=16, **asked)
    assert torch.equal(model.generate(**enc, do_sample=False, max_new_tokens=16, **settings), expected)
    with pytest.raises(ValueError, match="Unknown MARS setting.*mars_lookahead"):
        model.mars_settings(mars_lookahead=3, **asked)


@pytest.mark.parametrize("value", ["False", "yes", 1, 0, 1.0])
def test_mars_verify_must_be_a_bool(model, enc, value):
    with pytest.raises(ValueError, match="mars_verify must be True or False"):
        model.generate(**enc, max_new_tokens=4, mars_tau=0.5, mars_verify=value)
    with pytest.raises(ValueError, match="mars_verify must be True or False"):
        model.generate(**enc, max_new_tokens=4, generation_config=GenerationConfig(mars_verify=value))


def test_refusals_name_the_setting_wherever_it_is_held(model, enc):
    refused = [
        (dict(mars_tau=0.9, mars_block_size=100), "mars_block_size=100 exceeds .* trained with \\(4\\)"),
        (dict(mars_verify=True, mars_block_size=5), "mars_block_size=5 exceeds"),
        (dict(mars_tau=0.9, mars_draft_candidates=3), "mars_draft_candidates .* needs mars_verify=True"),
        (dict(mars_tau=0.9, mars_lookup=3), "mars_lookup .* needs mars_verify=True"),
        (dict(mars_tau=0.9, mars_lookahead=3), "Unknown MARS setting.*mars_lookahead"),
    ]
    for settings, words in refused:
        with pytest.raises(ValueError, match=words):
            model.generate(**enc, max_new_tokens=4, generation_config=GenerationConfig(**settings))
        if "mars_lookahead" not in settings:
            with pytest.raises(ValueError, match=words):
                model.generate(**enc, max_new_tokens=4, **settings)
    # A setting with no MARS mode to apply to is refused, not dropped
    with pytest.raises(ValueError, match="mars_draft_candidates has no effect without mars_tau"):
        model.generate(**enc, max_new_tokens=4, mars_draft_candidates=3)


def test_assisted_decoding_error_names_the_mode_in_use(model, enc):
    with pytest.raises(ValueError, match="`mars_verify` cannot be combined .*prompt_lookup_num_tokens.*mars_lookup"):
        model.generate(**enc, max_new_tokens=4, mars_verify=True, prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="`mars_tau` cannot be combined"):
        model.generate(**enc, max_new_tokens=4, mars_tau=0.9, prompt_lookup_num_tokens=3)
    held = GenerationConfig(mars_verify=True, prompt_lookup_num_tokens=3, max_new_tokens=4)
    with pytest.raises(ValueError, match="`mars_verify` cannot be combined .*prompt_lookup_num_tokens"):
        model.generate(**enc, generation_config=held)


class CountingProcessor(LogitsProcessor):
    """A processor with state of its own: it counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        return scores


def test_processors_with_state_are_called_as_generate_calls_them_or_refused(model, enc):
    one = {k: v[:1] for k, v in enc.items()}
    plain, mars = CountingProcessor(), CountingProcessor()
    reference = greedy(model, enc, logits_processor=LogitsProcessorList([plain]), eos_token_id=None)
    out = model.generate(
        **enc, mars_tau=1.0, max_new_tokens=16, logits_processor=LogitsProcessorList([mars]), eos_token_id=None
    )
    assert torch.equal(out, reference) and mars.calls == plain.calls == 16
    for mode, words in ((dict(mars_verify=True), "lossless mode"), (dict(mars_tau=0.9), "mars_tau=0.9")):
        with pytest.raises(ValueError, match=f"CountingProcessor is not .* stateless, and {words}"):
            model.generate(
                **one, max_new_tokens=4, logits_processor=LogitsProcessorList([CountingProcessor()]), **mode
            )
    # Classifier-free guidance runs the model on a cache of its own: exact at τ = 1, refused by name elsewhere
    guided = greedy(model, one, guidance_scale=1.5)
    assert torch.equal(model.generate(**one, mars_tau=1.0, max_new_tokens=16, guidance_scale=1.5), guided)
    for mode in (dict(mars_verify=True), dict(mars_verify=True, mars_draft_candidates=3), dict(mars_tau=0.5)):
        with pytest.raises(ValueError, match="`guidance_scale` \\(UnbatchedClassifierFreeGuidanceLogitsProcessor\\)"):
            model.generate(**one, max_new_tokens=4, guidance_scale=1.5, **mode)
        with pytest.raises(ValueError, match="`guidance_scale`"):  # the same, held in a config
            model.generate(**one, generation_config=GenerationConfig(guidance_scale=1.5, max_new_tokens=4, **mode))
    # Processors that read only the history and the scores stay exact in every mode
    kwargs = dict(repetition_penalty=1.3, no_repeat_ngram_size=2)
    expected = greedy(model, enc, **kwargs)
    assert torch.equal(model.generate(**enc, mars_verify=True, max_new_tokens=16, **kwargs), expected)


@pytest.mark.parametrize(
    "mode",
    [dict(mars_tau=1.0), dict(mars_verify=True), dict(mars_tau=0.6), dict(mars_verify=True, mars_draft_candidates=2)],
    ids=["tau1", "lossless", "tau0.6", "tree"],
)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_the_cache_is_returned_and_continues_a_conversation(model, enc, mode, static):
    """`return_dict_in_generate=True` returns the cache as `generate()` does; continuing from it, with plain
    `generate()` or with MARS, gives the tokens of a run over the whole text without a cache."""
    extra = dict(cache_implementation="static") if static else {}
    out = model.generate(**enc, max_new_tokens=12, return_dict_in_generate=True, **mode, **extra)
    held = GenerationConfig(max_new_tokens=12, return_dict_in_generate=True, **mode, **extra)
    assert getattr(model.generate(**enc, generation_config=held), CACHE_ARG) is not None  # the same, from a config
    cache = getattr(out, CACHE_ARG)
    assert cache is not None and 0 < cache.get_seq_length() < out.sequences.shape[1]
    grown = out.sequences.shape[1] - enc.input_ids.shape[1] + 2
    ids = torch.cat([out.sequences, torch.full((len(PROMPTS), 2), 7)], dim=1)
    attention = torch.cat([enc.attention_mask, torch.ones(len(PROMPTS), grown, dtype=torch.long)], dim=1)
    follow = dict(input_ids=ids, attention_mask=attention)
    expected = greedy(model, follow, max_new_tokens=8)
    for again in (dict(do_sample=False), dict(mars_tau=1.0), dict(mars_verify=True)):
        generate = GenerationMixin.generate if "do_sample" in again else type(model).generate
        continued = generate(model, **follow, max_new_tokens=8, **again, **{CACHE_ARG: copy.deepcopy(cache)})
        assert torch.equal(continued, expected), again
    # As `generate()`: with use_cache=False, no cache is returned
    out = model.generate(**enc, max_new_tokens=4, use_cache=False, return_dict_in_generate=True, **mode)
    assert getattr(out, CACHE_ARG) is None


def test_a_cache_that_covers_the_whole_input_is_refused(model, enc):
    out = model.generate(**enc, max_new_tokens=6, mars_tau=1.0, return_dict_in_generate=True)
    cache = getattr(out, CACHE_ARG)
    ids = out.sequences[:, : cache.get_seq_length()]
    with pytest.raises(ValueError, match="pass at least one new token"):
        model.generate(input_ids=ids, max_new_tokens=4, mars_tau=1.0, **{CACHE_ARG: cache})
