"""The training prompt mix: no prompt shares a word n-gram with an evaluation problem (GSM8K test, HumanEval), the
checker does catch contaminated text, and the mix keeps its shares, its licences and its size."""

from __future__ import annotations

import pytest
import reasoning_gym

from hf_mars.tools.data import sourcing as data
from hf_mars.tools.data.decontamination import NGRAM, eval_texts, ngrams, overlap
from hf_mars.tools.data.sourcing import SOURCES, Source, allocate, build_prompt_mix, parse_sources
from hf_mars.tools.evaluate.eval_sets import gsm8k_test, humaneval


@pytest.fixture(scope="module")
def mix():
    """A mix at gpu-run-1's scale (12,500 prompts), default sources."""
    return build_prompt_mix(12_500, seed=1)


def test_the_checker_flags_gsm_symbolic_and_planted_copies():
    # gsm_symbolic rewrites GSM8K test problems from templates (names and numbers change): most are caught
    symbolic = [x["question"] for x in reasoning_gym.create_dataset("gsm_symbolic", size=400, seed=7)]
    caught = sum(overlap(symbolic, eval_texts())) / len(symbolic)
    assert caught > 0.4, f"only {caught:.0%} of gsm_symbolic prompts flagged"
    # A GSM8K test question or a HumanEval docstring sentence inside a longer text is flagged; new text is not
    question = gsm8k_test()[100]["prompt"].split("\nGive the result")[0]
    docstring = humaneval()[10]["problem"]["prompt"]
    planted = [f"Here is a problem for you. {question} Think first.", "Write code.\n" + docstring]
    assert overlap(planted, eval_texts()) == [True, True]
    assert overlap(["A farmer sells 12 eggs on Monday and 7 eggs on Tuesday; how many in all?"], eval_texts()) == [
        False
    ]
    # Normalisation: case, punctuation and changed numbers do not hide a copy
    words = question.split()
    assert ngrams(question.upper().replace(",", " ;"), NGRAM) == ngrams(question, NGRAM)
    renumbered = " ".join("97" if w.strip(".,$").isdigit() else w for w in words)
    assert overlap([renumbered], eval_texts()) == [True]


def test_the_mix_shares_no_ngram_with_the_evaluation_sets(mix):
    prompts, report = mix
    assert len(prompts) == 12_500 and report["ngram"] == NGRAM
    assert not any(overlap([p["prompt"] for p in prompts], eval_texts()))
    # independently of the n-gram check: no evaluation problem's opening is a training prompt's
    openings = {text.strip()[:60] for text in eval_texts()}
    assert not any(p["prompt"][:60] in openings for p in prompts)
    assert not {"gsm_symbolic", "sciq", "coqa_nc"} & {p["source"] for p in prompts}


def test_the_mix_holds_every_default_source_in_its_share(mix):
    prompts, report = mix
    sources = {p["source"] for p in prompts}
    assert {"math", "arc_easy", "drop", "squad", "naturalqs", "coqa", "mbpp"} <= sources
    assert set(data.GYM_TASKS) <= sources
    assert sum(report["counts"].values()) == len(prompts)
    # a source with enough prompts gets its share: math is asked for 35% and has 5,000
    assert abs(report["counts"]["math"] / len(prompts) - SOURCES["math"].share) < 0.01
    assert all(isinstance(p["reference"], str) and p["reference"] for p in prompts)
    by_source = {p["source"]: p for p in prompts}
    assert by_source["math"]["prompt"].endswith("Solve it step by step.")
    assert by_source["mbpp"]["reference"].startswith("```python\n")
    assert by_source["arc_easy"]["reference"][:3] in {"A. ", "B. ", "C. ", "D. ", "E. "}
    assert len({p["prompt"] for p in prompts}) == len(prompts)
    assert build_prompt_mix(500, seed=1)[0] == build_prompt_mix(500, seed=1)[0]  # reproducible


def test_default_sources_carry_licences_an_apache_model_can_ship():
    for name, source in SOURCES.items():
        assert source.licence
        non_commercial = "NC" in source.licence or "non-commercial" in source.licence
        assert source.default != non_commercial, name


def test_overlapping_prompts_are_dropped_at_build_time_and_counted(monkeypatch):
    question = gsm8k_test()[5]["prompt"].split("\nGive the result")[0]
    rows = [
        {"prompt": f"Word problem {i}: pens cost {i} dollars.", "source": "planted", "reference": "x"}
        for i in range(20)
    ]
    rows.append({"prompt": "Solve this. " + question, "source": "planted", "reference": "x"})
    monkeypatch.setitem(SOURCES, "planted", Source("test", 1.0, lambda: rows))
    prompts, report = build_prompt_mix(20, ["planted"])
    assert report["dropped_overlapping"] == {"planted": 1}
    assert len(prompts) == 20 and not any(question in p["prompt"] for p in prompts)
    with pytest.raises(ValueError, match="supply 20"):
        build_prompt_mix(21, ["planted"])


def test_fixed_pools_run_out_and_the_generators_fill_up():
    shares = {"a": 0.5, "b": 0.3, "gym:x": 0.2}
    assert allocate(100, shares, {"a": 1000, "b": 1000, "gym:x": None}) == {"a": 50, "b": 30, "gym:x": 20}
    filled = allocate(1000, shares, {"a": 100, "b": 1000, "gym:x": None})
    assert filled["a"] == 100 and sum(filled.values()) == 1000
    assert filled["b"] / filled["gym:x"] == pytest.approx(1.5, rel=0.01)  # the rest keeps its proportions
    assert allocate(500, {"a": 1, "b": 1}, {"a": 100, "b": 400}) == {"a": 100, "b": 400}
    with pytest.raises(ValueError, match="supply 500: add `gym`"):
        allocate(501, {"a": 1, "b": 1}, {"a": 100, "b": 400})
    big = build_prompt_mix(3000, ["mbpp=0.5", "gym:chain_sum=0.5"], seed=2)[1]
    assert big["counts"] == {"mbpp": 499, "gym:chain_sum": 2501}  # MBPP's 499 distinct problems, then the generator


def test_sources_are_named_with_optional_shares():
    assert parse_sources(["math=2", "mbpp"]) == {"math": 2.0, "mbpp": SOURCES["mbpp"].share}
    gym = parse_sources(["gym=0.5"])
    assert set(gym) == {f"gym:{t}" for t in data.GYM_TASKS} and sum(gym.values()) == pytest.approx(0.5)
    assert parse_sources(["gym:leg_counting"]) == {"gym:leg_counting": SOURCES["gym"].share}
    assert set(parse_sources(None)) == {n for n in SOURCES if SOURCES[n].default and n != "gym"} | set(gym)
    for bad, message in [
        (["gym:gsm_symbolic"], "GSM8K test"),
        (["wikipedia"], "unknown prompt source"),
        (["math=lots"], "must be a number"),
        (["math=0"], "must be positive"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_sources(bad)
