"""The benchmark harness: every method measured the same way, cells that add up, files written."""

from __future__ import annotations

import json

import torch
from helpers import auto_lossless_model, make_model, make_tokenizer

import hf_mars
from hf_mars.tools.evaluate.evals import load_prompts
from hf_mars.tools.measure.bench import format_table, run_benchmark, save
from hf_mars.tools.measure.calibrate import measure_mask_cost
from hf_mars.tools.measure.decode import generate_ar


def _sharp_model():
    """`(model, tokenizer, prompts)`: a tiny MARS model (B = 4) confident enough for τ-mode to accept masks, and 4
    toy prompts."""
    tok = make_tokenizer()
    model = make_model("qwen2", dtype=torch.float64)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    hf_mars.to_mars(model, tok, block_size=4)
    return model, tok, load_prompts(None, tok, limit=4)


def test_benchmark_cells_and_files(tmp_path):
    model, tok, prompts = _sharp_model()
    assert all(p["answer"] and p["text"].endswith("assistant\n") for p in prompts)
    cells = run_benchmark(
        model,
        tok,
        prompts,
        taus=(1.0, 0.5),
        batch_sizes=(1, 2),
        max_new_tokens=12,
        repeats=2,
        mask_costs=(0.0, 0.2, "auto"),
        trees=[(2, 3, 0), (2, 2, 4)],
        progress=False,
    )
    by = {(c.method, c.batch_size): c for c in cells}
    names = ("ar", "mars tau=1.0", "lossless tau=1.0", "mars tau=0.5", "lossless tau=0.5")
    names += (
        "mars cost=0.2 tau=0.5",
        "lossless cost=0.2 tau=0.5",
        "mars cost=auto tau=0.5",
        "lossless cost=auto tau=0.5",
    )
    for tree in ("2x3", "2x2+4"):
        names += (
            f"lossless {tree} tau=0.5",
            f"lossless cost=0.2 {tree} tau=0.5",
            f"lossless cost=auto {tree} tau=0.5",
        )
    # τ = 1 feeds no mask: no cell with a cost
    assert set(by) == {(m, b) for m in names for b in (1, 2)} | {("prompt-lookup", 1)}  # prompt lookup: batch 1 only
    for b in (1, 2):
        assert by["ar", b].speedup == 1.0 and by["ar", b].tokens_per_forward == 1.0
        assert by["mars tau=1.0", b].tokens_per_forward == 1.0 and by["mars tau=1.0", b].agreement == 1.0
        assert by["lossless tau=0.5", b].agreement == 1.0  # lossless mode: same text as AR, whatever the schedule
        assert by["lossless cost=0.2 tau=0.5", b].agreement == by["lossless cost=auto tau=0.5", b].agreement == 1.0
        assert by["lossless 2x3 tau=0.5", b].agreement == 1.0  # a draft tree: still AR's text
        assert by["lossless 2x2+4 tau=0.5", b].agreement == 1.0  # with a prompt-lookup branch too
        assert by["mars tau=0.5", b].tokens_per_forward > 1.2  # the sharp model accepts several tokens per pass
        cell = by["mars tau=0.5", b]
        assert abs(cell.efficiency - cell.speedup / cell.tokens_per_forward) < 1e-9
        assert all(0.0 < c.forward_share < 1.0 for c in cells)  # time in the forward, the rest is overhead
    table = format_table(cells)
    assert "prompt-lookup" in table and "lossless tau=0.5" in table
    save(cells, tmp_path / "bench.json", tmp_path / "bench.png", meta={"device": "cpu"})
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["meta"]["device"] == "cpu" and len(data["cells"]) == len(cells)
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_a_sampled_benchmark_draws_every_method_from_one_seed(monkeypatch):
    """`decoding` sampled (`hf-mars bench --temperature`): plain decoding and MARS sample, each run from the same
    seed, so MARS at τ = 1 draws plain sampling's very tokens (agreement 1.0) while τ-mode draws others; prompt lookup
    (greedy) is refused with it."""
    from hf_mars.tools.measure import bench

    model, tok, prompts = _sharp_model()
    sampling = dict(do_sample=True, temperature=0.8)
    calls = []
    monkeypatch.setattr(bench, "generate_ar", lambda model, **kw: calls.append(kw) or generate_ar(model, **kw))
    common = dict(batch_sizes=(2,), max_new_tokens=16, repeats=1, mask_costs=(0.0,), progress=False)
    cells = run_benchmark(model, tok, prompts, taus=(1.0, 0.3), prompt_lookup=0, decoding=sampling, **common)
    assert calls and all(kw["do_sample"] and kw["temperature"] == 0.8 for kw in calls)
    by = {c.method: c for c in cells}
    assert by["mars tau=1.0"].agreement == by["lossless tau=1.0"].agreement == 1.0  # the same seed, the same draws
    assert by["mars tau=0.3"].agreement < 1.0 and by["mars tau=0.3"].tokens_per_forward > 1.0
    try:
        run_benchmark(model, tok, prompts, taus=(1.0,), prompt_lookup=4, decoding=sampling, **common)
    except ValueError as err:
        assert "prompt_lookup=0" in str(err)
    else:
        raise AssertionError("prompt lookup is greedy: it must be refused with sampling")


def test_prompts_from_jsonl(tmp_path):
    tok = make_tokenizer()
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "hi", "answer": "yo"}\n'
        '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n'
    )
    first, second = load_prompts(path, tok)
    assert first["answer"] == "yo" and "hi" in first["text"]
    assert first["check"](" yo\n") and not first["check"]("no")
    assert second["answer"] == "b" and "b" not in second["text"].split("assistant")[-1]
    path.write_text('{"nothing": 1}\n')
    try:
        load_prompts(path, tok)
    except ValueError as err:
        assert "line 1" in str(err)
    else:
        raise AssertionError("a line without a prompt must be refused")


def test_heldout_prompts_are_scored_by_task():
    from hf_mars.tools.evaluate.eval_sets import gsm8k_test, humaneval

    tok = make_tokenizer()
    prompts = load_prompts("heldout", tok, limit=4)
    assert len(prompts) == 4
    gsm, code = gsm8k_test()[0], humaneval()[0]["problem"]
    assert gsm["prompt"] in prompts[0]["text"] and code["entry_point"] in prompts[1]["text"]
    assert prompts[0]["check"](f"So the answer is {gsm['answer']}.") and not prompts[0]["check"](
        "So the answer is -1."
    )
    solution = "```python\n" + code["prompt"] + code["canonical_solution"] + "```"
    assert prompts[1]["check"](solution) and not prompts[1]["check"]("```python\npass\n```")


def test_tuning_prompts_are_evaluated_nowhere():
    """`tune`'s default prompts share no problem with what `eval` and `bench` score (GSM8K test's first 256, all of
    HumanEval), nor a word n-gram with any evaluation problem; GSM8K rows keep their answer check."""
    from hf_mars.tools.data.decontamination import eval_texts, overlap
    from hf_mars.tools.evaluate.eval_sets import TUNING_GSM8K_FROM, gsm8k_test, humaneval
    from hf_mars.tools.evaluate.evals import tuning_problems

    gsm, code = tuning_problems()
    assert TUNING_GSM8K_FROM >= 256 and len(gsm) > 256 and len(code) > 256
    scored = {row["prompt"] for row in gsm8k_test()[:256]} | {row["prompt"] for row in humaneval()}
    assert scored.isdisjoint(row["prompt"] for row in gsm + code)
    assert not any(overlap([row["prompt"] for row in code], eval_texts()))
    assert all(row["prompt"].rstrip("`\n").split("\n")[-1].strip() != "return" for row in code)

    prompts = load_prompts("tuning", make_tokenizer(), limit=4)
    assert [gsm[0]["prompt"] in p["text"] for p in prompts] == [True, False, False, False]
    assert code[1]["prompt"] in prompts[3]["text"] and prompts[1]["check"] is None
    assert prompts[0]["check"](f"So the answer is {gsm[0]['answer']}.") and not prompts[0]["check"]("It is -1.")


def test_new_tokens_count_the_eos_even_when_it_is_the_pad_token():
    from types import SimpleNamespace

    from hf_mars.tools.measure.decode import count_new_tokens

    generated = torch.tensor([[5, 6, 2, 2, 2], [5, 6, 7, 8, 9], [2, 2, 2, 2, 2]])
    assert count_new_tokens(generated, SimpleNamespace(pad_token_id=2), [2]) == 3 + 5 + 1
    padded = torch.tensor([[5, 3, 0, 0], [5, 6, 7, 8], [5, 6, 0, 0]])  # pad 0, EOS 3; row 3 stopped by a criterion
    assert count_new_tokens(padded, SimpleNamespace(pad_token_id=0), [3]) == 2 + 4 + 2


def test_measure_mask_cost():
    """Timed, so only its range can be checked. What can be checked exactly is what it times: at batch > 1, passes
    with an attention mask that has holes (as batched decoding's passes have), at batch 1 mask-free passes."""
    tok = make_tokenizer()
    model = hf_mars.to_mars(make_model("llama"), tok, block_size=4)
    seen = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("attention_mask")), with_kwargs=True)
    costs = measure_mask_cost(model, batch_size=2, context=32, repeats=3)
    assert len(costs) == 3 and all(isinstance(c, float) and 0.0 <= c < 10.0 for c in costs)  # 1, 2, 3 masks
    assert len(seen) == 1 + 4 * 4 and all(m is not None and m.shape[0] == 2 for m in seen)
    assert all(bool(m[0].all()) and not bool(m[1].all()) for m in seen)  # row 2 left-padded, as in a batch
    seen.clear()
    measure_mask_cost(model, batch_size=1, context=32, repeats=1)
    assert len(seen) == 1 + 2 * 4 and all(m is None for m in seen)
    hook.remove()
    assert measure_mask_cost(hf_mars.to_mars(make_model("llama"), tok, block_size=1)) == []  # no mask, no cost


def test_compiled_benchmark_runs_static_and_compiled_without_recompiling(monkeypatch):
    """`compiled=True` (`hf-mars bench --compile`): plain generate() and MARS on a static cache through generate()'s
    compile path, warmed up on the longest batch so that the timed runs compile nothing; prompt lookup stays eager.
    The eager dynamo backend keeps the test fast: it guards and recompiles as inductor does."""
    import functools

    import transformers
    from torch._dynamo.utils import counters

    monkeypatch.setattr(transformers, "CompileConfig", functools.partial(transformers.CompileConfig, backend="eager"))
    tok = make_tokenizer()
    model = hf_mars.to_mars(make_model("llama"), tok, block_size=4)
    prompts = load_prompts(None, tok, limit=4)
    torch._dynamo.reset()
    kwargs = dict(taus=(1.0, 0.5), max_new_tokens=10, mask_costs=(0.0,), progress=False, compiled=True)
    run_benchmark(model, tok, prompts, batch_sizes=(2,), repeats=1, **kwargs)  # compiles every method
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        cells = run_benchmark(model, tok, prompts, batch_sizes=(2,), repeats=2, **kwargs)
    assert counters["stats"]["unique_graphs"] == graphs > 0
    by = {c.method: c for c in cells}
    assert {"ar", "mars tau=1.0", "mars tau=0.5", "lossless tau=0.5"} <= set(by)
    assert by["mars tau=1.0"].agreement == by["lossless tau=0.5"].agreement == 1.0
    assert by["ar"].forward_share is None  # compiled forwards carry no timing hooks


def test_a_compiled_benchmark_sizes_its_cache_for_every_tree_auto_may_pick_without_timing(monkeypatch):
    """Lossless `"auto"` picks a tree of the checkpoint's `mars_acceptance` on the compiled path: the one static
    cache fits each, and sizing it times nothing (not the eager path, which a compiled run never takes)."""
    from hf_mars.tools.measure import passes
    from hf_mars.tools.measure.decode import static_compiled

    model, _ = auto_lossless_model()

    def untimed(*args, **kwargs):
        raise AssertionError("sizing a cache must time nothing")

    monkeypatch.setattr(passes, "measure_pass_costs", untimed)
    monkeypatch.setattr(passes, "measure_compiled_passes", untimed)
    slots = static_compiled(model, 20, 16, [1, 2])["max_cache_len"]
    widest = model.mars_cache_length(
        20, 16, 2, mars_verify=True, mars_block_size=4, mars_draft_candidates=3, mars_lookup=8
    )
    assert slots == widest


def test_a_penalised_benchmark_decodes_every_method_with_the_penalty(monkeypatch):
    """`decoding` with a repetition penalty (`hf-mars bench --repetition-penalty`): plain decoding, prompt lookup and
    MARS all decode with it, and lossless mode keeps plain's penalised text (agreement 1.0)."""
    from hf_mars.tools.measure import bench

    model, tok, prompts = _sharp_model()
    calls = []
    monkeypatch.setattr(bench, "generate_ar", lambda model, **kw: calls.append(kw) or generate_ar(model, **kw))
    penalty = dict(repetition_penalty=1.5)
    common = dict(batch_sizes=(1,), max_new_tokens=16, repeats=1, mask_costs=(0.0,), progress=False)  # lookup: 1
    cells = run_benchmark(model, tok, prompts, taus=(0.5,), prompt_lookup=3, decoding=penalty, **common)
    assert calls and all(kw["repetition_penalty"] == 1.5 for kw in calls)
    by = {c.method: c for c in cells}
    assert by["lossless tau=0.5"].agreement == 1.0 and by["prompt-lookup"].agreement == 1.0
    enc = tok([p["text"] for p in prompts], return_tensors="pt", padding=True)
    plain = [generate_ar(model, **enc, max_new_tokens=16, **extra)[0] for extra in ({}, penalty)]
    assert not torch.equal(*plain), "the premise: the penalty changes the text"


def test_lossless_mode_runs_at_its_own_default_tau_beside_the_default_sweep():
    """`hf-mars bench` without `--taus` sweeps τ-mode from 1 down and runs lossless mode at each of those τs and at
    its own default, τ = 0 (every draft proposed), which the sweep leaves out; given `--taus`, both modes run at
    those alone."""
    from hf_mars.cli.bench import TAUS, sweep
    from hf_mars.tools.measure.bench import methods

    default = set(methods(verify=True, prompt_lookup=0, **sweep(None)))
    assert "lossless tau=0.0" in default and "mars tau=0.0" not in default
    assert {f"mars tau={tau}" for tau in TAUS} | {f"lossless tau={tau}" for tau in TAUS} <= default
    asked = set(methods(verify=True, prompt_lookup=0, **sweep([0.9])))
    assert asked == {"ar", "mars tau=0.9", "lossless tau=0.9"}
