"""`mars_lossless="auto"`: the tree chosen from the checkpoint's tokens per forward and this machine's pass costs
(`decoding/costs.py`, which reads them), their timing (`tools/measure/passes.py`, `hf_mars.measure`), the costs' cache
and what invalidates it, and the output, which stays greedy `generate()`'s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import make_model, make_tokenizer, toy_prompts
from transformers import CompileConfig, GenerationMixin

import hf_mars
from hf_mars.decoding import costs as cost_model
from hf_mars.decoding.costs import Costs, NotMeasured, choose_tree, machine_key, parse_tree, pass_width
from hf_mars.tools.measure import dtypes, passes
from hf_mars.tools.measure.passes import pass_costs

ACCEPTANCE = {"2x1": 1.6, "2x3+4": 2.1, "4x3+8": 2.6}  # tokens per forward, as `hf-mars tune` measures them
WIDTHS = sorted({1, *(pass_width(*parse_tree(name)) for name in ACCEPTANCE)})


def table(seconds_per_extra_token: float) -> dict[int, float]:
    """Forward costs by width: 10 ms for one token, plus this much per further token."""
    return {w: 0.010 + seconds_per_extra_token * (w - 1) for w in WIDTHS}


def costs(seconds_per_extra_token: float, plain_overhead: float = 0.0, mars_overhead: float = 0.0) -> Costs:
    return Costs(table(seconds_per_extra_token), plain_overhead, mars_overhead)


def test_trees_are_named_and_sized_as_a_lossless_pass_builds_them():
    assert parse_tree("2x3+4") == (2, 3, 4) and parse_tree("4x1") == (4, 1, 0)
    assert pass_width(2, 1, 0) == 4  # root + one draft, each followed by one mask
    assert pass_width(2, 3, 4) == (1 + 1 + 2 + 4) * 2  # root, B-1 drafts, 2 runner-ups, 4 lookup drafts
    for bad in ("1x2", "2x0", "2-3", "x3+1", ""):
        with pytest.raises(ValueError, match="BxN"):
            parse_tree(bad)


def test_free_width_picks_the_widest_tree_and_costly_width_picks_none():
    assert choose_tree(ACCEPTANCE, costs(0.0)) == (4, 3, 8)  # a pass costs the same at any width (a GPU, batch 1)
    assert choose_tree(ACCEPTANCE, costs(0.0002)) == (2, 3, 4)  # wide passes cost a little: a medium tree pays most
    assert choose_tree(ACCEPTANCE, costs(0.001)) == (2, 1, 0)  # only the narrowest still pays
    assert choose_tree(ACCEPTANCE, costs(0.01)) is None  # every tree loses to plain decoding: no drafts
    # A tree must beat plain decoding by the margin, not merely tie it
    assert choose_tree({"2x1": 1.05}, Costs({1: 1.0, 4: 1.0})) is None
    assert choose_tree({"2x1": 1.05}, Costs({1: 1.0, 4: 1.0}), margin=1.0) == (2, 1, 0)


def test_the_loop_s_own_time_per_step_counts():
    """Where a step's host work sets its time (a small model on a GPU), a lossless pass that does more of it than a
    plain step must earn that too: free width alone does not make a tree pay."""
    assert choose_tree(ACCEPTANCE, costs(0.0, plain_overhead=0.005, mars_overhead=0.005)) == (4, 3, 8)
    assert choose_tree(ACCEPTANCE, costs(0.0, plain_overhead=0.005, mars_overhead=0.020)) == (4, 3, 8)  # 2.6/30 ms
    assert choose_tree(ACCEPTANCE, costs(0.0, plain_overhead=0.005, mars_overhead=0.050)) is None  # 2.6/60 ms


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_MARS_CACHE", str(tmp_path))
    return tmp_path


def counting(monkeypatch, measured: dict[int, float] | None = None) -> list:
    """Replace the clock: every forward measurement is recorded, and returns `measured` (or 1 ms per token); a step
    adds nothing to its forward."""
    calls = []

    def measure(model, batch_size, widths, **_):
        calls.append((model.dtype, batch_size, tuple(widths)))
        return {w: (measured or {}).get(w, 0.001 * w) for w in widths}

    monkeypatch.setattr(passes, "measure_pass_costs", measure)
    monkeypatch.setattr(passes, "measure_overheads", lambda *a, **k: dict(plain_overhead=0.0, mars_overhead=0.0))
    return calls


def test_pass_costs_are_measured_once_per_machine_dtype_batch_and_model_shape(cache_dir, monkeypatch):
    calls = counting(monkeypatch)
    model = make_model("llama")
    first = pass_costs(model, 1, [4, 16])
    assert calls == [(torch.float32, 1, (1, 4, 16))] and set(first.forward) == {1, 4, 16}
    assert pass_costs(model, 1, [16, 4]) == first and len(calls) == 1  # cached: not measured again
    saved = json.loads((cache_dir / "pass_costs.json").read_text())
    assert list(saved) == [machine_key(model, 1)] and "float32" in machine_key(model, 1)
    pass_costs(model, 1, [4, 8])  # a new width: only it is measured
    assert calls[-1] == (torch.float32, 1, (8,))
    pass_costs(model, 4, [4])  # another batch size
    pass_costs(model.to(torch.bfloat16), 1, [4])  # another dtype
    pass_costs(make_model("llama", hidden_size=96, intermediate_size=192), 1, [4])  # another model shape
    assert [c[:2] for c in calls[-3:]] == [(torch.float32, 4), (torch.bfloat16, 1), (torch.float32, 1)]
    assert len(json.loads((cache_dir / "pass_costs.json").read_text())) == 4
    pass_costs(model.to(torch.float32), 1, [4], refresh=True)  # `hf-mars tune --refresh-costs`
    assert calls[-1] == (torch.float32, 1, (1, 4))


def test_reading_costs_never_times(cache_dir, monkeypatch):
    """The code a checkpoint carries reads the table and times nothing: a cost it lacks raises `NotMeasured` unless
    hf_mars's tooling hands it a timer."""
    calls = counting(monkeypatch)
    model = make_model("llama")
    with pytest.raises(NotMeasured):
        cost_model.pass_costs(model, 1, [4])
    timed = pass_costs(model, 1, [4, 8])
    assert cost_model.pass_costs(model, 1, [8, 4]) == timed and len(calls) == 1
    with pytest.raises(NotMeasured):
        cost_model.pass_costs(model, 1, [4], prefill=True)  # the prompt's forward was not timed
    shipped = Path(cost_model.__file__).read_text()
    assert "perf_counter" not in shipped and "def measure_" not in shipped


def test_costs_timed_beside_other_work_are_never_chosen_from_and_timed_again_on_an_idle_machine(
    cache_dir, monkeypatch, caplog
):
    """Figures timed while another process held part of the CPU are saved marked busy, said to be off, and no choice
    rests on them, not even in the process that timed them (it chooses from what is known of this kind of device);
    the next process that finds the machine idle times them again, and figures timed alone are kept."""
    calls = counting(monkeypatch)
    model = make_model("llama")
    monkeypatch.setattr(passes, "timing_share", lambda started: 0.4)  # another process held most of the cores
    with caplog.at_level("WARNING", logger=passes.__name__), pytest.raises(NotMeasured):
        pass_costs(model, 1, [4])
    saved = json.loads((cache_dir / "pass_costs.json").read_text())[machine_key(model, 1)]
    assert saved["busy"] == 0.4 and "other work was running" in caplog.text and "not used" in caplog.text
    with pytest.raises(NotMeasured):
        pass_costs(model, 1, [4])  # this process does not time them twice, nor use them
    assert len(calls) == 1
    with pytest.raises(NotMeasured):
        cost_model.pass_costs(model, 1, [4])  # the checkpoint's code does not decode with them either

    passes._DECLINED.clear()  # the next process, on an idle machine
    monkeypatch.setattr(passes, "timing_share", lambda started: 0.97)
    timed = pass_costs(model, 1, [4])
    assert calls[-1][2] == (1, 4) and len(calls) == 2  # every width again
    assert "busy" not in json.loads((cache_dir / "pass_costs.json").read_text())[machine_key(model, 1)]
    assert cost_model.pass_costs(model, 1, [4]) == timed
    pass_costs(model, 1, [4])
    assert len(calls) == 2  # figures timed alone stay


def test_a_busy_machine_is_not_timed_and_auto_chooses_from_what_is_known_of_its_kind(
    auto_model, cache_dir, monkeypatch, caplog
):
    """Where other work holds cores torch's threads would use, timing declines before it starts (said once, and not
    probed again in this process); `"auto"` then chooses from the prior for this kind of device, and the output is
    greedy `generate()`'s all the same."""
    calls = counting(monkeypatch)
    model, tok = auto_model
    enc = toy_prompts(tok, n=2, seed=5)
    probes = []
    monkeypatch.setattr(passes, "busy_cores", lambda threads=None: probes.append(1) or 1)
    with caplog.at_level("WARNING", logger=passes.__name__):
        measured = hf_mars.measure(model, [1], mars_verify=True)[1]
        hf_mars.measure(model, [1], mars_verify=True)
    assert calls == [] and len(probes) == 1 and "not timed now" in caplog.text
    assert not (cache_dir / "pass_costs.json").exists()
    prior = cost_model.prior_costs(model, 1, WIDTHS)
    expected = choose_tree(ACCEPTANCE, prior) or (1, 1, 0)
    assert measured["mars_block_size"] == expected[0] == model.mars_settings(mars_verify=True)["mars_block_size"]
    out = model.generate(**enc, mars_verify=True, max_new_tokens=12)
    assert torch.equal(out, GenerationMixin.generate(model, **enc, do_sample=False, max_new_tokens=12))
    with pytest.raises(NotMeasured):
        cost_model.pass_costs(model, 1, [4])
    passes._DECLINED.clear()


def test_the_prior_drafts_where_drafting_is_known_to_pay_and_not_where_it_is_known_not_to(monkeypatch):
    """Untimed, `"auto"` still drafts on a GPU and on a CPU that computes bfloat16 natively (a wide pass costs little
    more than a one-token one there), and in float32 on any CPU at batch 1, but not in bfloat16 emulated on a CPU
    without AVX512-BF16, where each further token costs about a quarter of a one-token pass. The shipped checkpoint's
    trees."""
    from hf_mars.tools.checkpoints.shipped import ACCEPTANCE as SHIPPED

    model = make_model("llama")
    widths = [pass_width(*parse_tree(name)) for name in SHIPPED]

    def chosen(kind: str, dtype, batch: int = 1):
        monkeypatch.setattr(cost_model, "device_kind", lambda m: kind)
        return choose_tree(SHIPPED, cost_model.prior_costs(model.to(dtype), batch, widths))

    assert chosen("cuda", torch.bfloat16) is not None and chosen("cuda", torch.bfloat16, 8) is not None
    assert chosen("cpu, native bfloat16", torch.bfloat16) is not None
    assert chosen("cpu, float32", torch.float32) is not None
    assert chosen("cpu, emulated 16-bit", torch.bfloat16) is None
    # Cost grows with the pass's tokens over all rows: a batch of 8 leaves a GPU less room than a batch of 1
    monkeypatch.setattr(cost_model, "device_kind", lambda m: "cuda")
    one, eight = (cost_model.prior_costs(model, b, [16]) for b in (1, 8))
    assert one.forward[16] / one.forward[1] < eight.forward[16] / eight.forward[1]
    # bfloat16 reads half the bytes of float32: its one-token pass is the cheaper in the prior's units
    assert (
        cost_model.prior_costs(model.to(torch.bfloat16), 1, [4]).forward[1]
        < cost_model.prior_costs(model.to(torch.float32), 1, [4]).forward[1]
    )


def test_the_device_kind_reads_the_device_the_dtype_and_the_cpu_s_flags(monkeypatch):
    model = make_model("llama")
    assert cost_model.device_kind(model) == "cpu, float32"
    monkeypatch.setattr(cost_model, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert cost_model.device_kind(model.to(torch.bfloat16)) == "cpu, native bfloat16"
    monkeypatch.setattr(cost_model, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert cost_model.device_kind(model.to(torch.bfloat16)) == "cpu, emulated 16-bit"
    assert cost_model.prior_cost("cpu, float32", 1) == 1.0
    assert cost_model.prior_cost("cpu, float32", 3) == pytest.approx((1.7 + 1.9) / 2)  # between two points
    assert cost_model.prior_cost("cpu, float32", 96) > cost_model.prior_cost("cpu, float32", 64)  # past the last


def test_cpu_share_tells_work_from_waiting():
    """The share is CPU time over wall time: near 0 while this thread sleeps, as it would while another process holds
    the CPU, and far above that while it computes (near 1 on an idle core; on a machine other processes keep busy, the
    core's share the scheduler gives it, which this test must pass beside)."""
    import time

    from hf_mars.tools.measure import cpu_load

    started = cpu_load.clocks()
    end = time.perf_counter() + 0.2
    while time.perf_counter() < end:
        pass
    working = cpu_load.cpu_share(started)
    started = cpu_load.clocks()
    time.sleep(0.2)
    waiting = cpu_load.cpu_share(started)
    assert waiting < 0.2 and working > 2 * waiting + 0.1, (working, waiting)


def test_timing_share_counts_the_cores_other_processes_held_not_this_ones_waiting(monkeypatch):
    """Pass costs are trusted by the cores other processes left torch's threads while they were timed (the machine's
    busy time less this process's), not by this process's own CPU time: a small forward keeps two threads waiting for
    work on an idle machine. Over a second of wall time on 2 cores with 2 threads: others busy for a tenth of a
    second leave 95%; a whole core, 50%; where the machine does not say, the share is `cpu_share`'s."""
    import os
    import time

    from hf_mars.tools.measure import cpu_load

    ticks = os.sysconf("SC_CLK_TCK")
    monkeypatch.setattr(cpu_load, "cores", lambda: 2)
    monkeypatch.setattr(cpu_load.torch, "get_num_threads", lambda: 2)
    for others, share in ((0.1, 0.95), (1.0, 0.5)):
        monkeypatch.setattr(cpu_load, "_cpu_times", lambda others=others: (others * ticks, 4.0 * ticks))
        started = (time.perf_counter() - 1.0, time.process_time(), (0.0, 0.0))
        assert cpu_load.timing_share(started) == pytest.approx(share, abs=0.02)
    monkeypatch.setattr(cpu_load, "_cpu_times", lambda: None)
    started = (time.perf_counter() - 1.0, time.process_time(), None)
    assert cpu_load.timing_share(started) == pytest.approx(cpu_load.cpu_share(started), abs=0.02)


def test_a_core_is_busy_only_where_every_probe_finds_it_so(monkeypatch):
    """A burst of other work (the kernel writing back a checkpoint just saved) is not a process that stays: the
    machine counts as busy only where a second look still finds the core held, and a look is spared where the first
    finds the cores free."""
    from hf_mars.tools.measure import cpu_load

    def looks(*free):
        seen = list(free)
        monkeypatch.setattr(cpu_load, "free_cores", lambda seconds=0.25: seen.pop(0))
        return seen

    seen = looks(1.0, 2.0)
    assert cpu_load.busy_cores(2) == 0 and not seen  # busy, then free: a burst
    seen = looks(1.0, 1.1)
    assert cpu_load.busy_cores(2) == 1 and not seen  # held in both looks
    seen = looks(2.0, 1.0)
    assert cpu_load.busy_cores(2) == 0 and seen == [1.0]  # free at once: no second look
    looks(None, None)
    assert cpu_load.busy_cores(2) == 0  # a machine that does not say


def test_another_device_or_thread_count_is_another_machine(cache_dir, monkeypatch):
    model = make_model("llama")
    key = machine_key(model, 1)
    other = "AVX512" if torch.backends.cpu.get_cpu_capability() == "AVX2" else "AVX2"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: other)
    assert machine_key(model, 1) != key  # other instructions: other kernels
    monkeypatch.undo()
    monkeypatch.setattr(cost_model, "MEASUREMENT", cost_model.MEASUREMENT + 1)
    assert machine_key(model, 1) != key  # measured another way: measured again
    monkeypatch.undo()
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert machine_key(model, 1) != key
    finally:
        torch.set_num_threads(threads)
    assert machine_key(model, 1) == key
    import hf_mars.decoding.ordered_attention  # noqa: F401 (registers `ordered`, as a MARS checkpoint's code does)

    attention = model.config._attn_implementation
    model.set_attn_implementation("ordered")  # other attention, other costs
    assert machine_key(model, 1) != key and "attention ordered" in machine_key(model, 1)
    model.set_attn_implementation(attention)
    assert machine_key(model, 1) == key


def test_real_measurement_times_every_width_with_the_batch_mask(cache_dir):
    """Both measurements run at batch > 1 with a padded batch's mask, as batched decoding of real prompts does: a
    mask with holes takes attention's masked path, at another speed."""
    model = hf_mars.to_mars(make_model("llama"), make_tokenizer(), block_size=2)
    masks = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: masks.append(kw.get("attention_mask")), with_kwargs=True)
    try:
        measured = passes.measure_pass_costs(model, 2, [1, 4, 8], context=16, repeats=2)
        timed_forwards = len(masks)
        overheads = passes.measure_overheads(model, 2, measured, context=16, repeats=1)  # real generate() calls
    finally:
        hook.remove()
    assert set(measured) == {1, 4, 8} and all(0.0 < s < 5.0 for s in measured.values())
    assert set(overheads) == {"plain_overhead", "mars_overhead"} and all(0.0 <= s < 5.0 for s in overheads.values())
    assert None not in masks
    for part in (masks[:timed_forwards], masks[timed_forwards:]):  # the forwards, then plain and lossless steps
        padded = [m for m in part if m.dim() == 2]  # lossless mode's steps pass 4D tree masks of their own
        assert padded and not any(m.all() for m in padded)
    assert model.generation_config.eos_token_id is not None  # the timing runs' config was a copy


@pytest.fixture
def auto_model(trained_toy):
    """The trained toy checkpoint with `mars_lossless="auto"` and measured tokens per forward."""
    model, tok = trained_toy
    config = model.generation_config
    config.mars_lossless, config.mars_acceptance = "auto", dict(ACCEPTANCE)
    try:
        yield model, tok
    finally:
        del config.mars_lossless, config.mars_acceptance


@pytest.mark.parametrize("extra_token_cost,tree", [(0.0, (4, 3, 8)), (0.001, (2, 1, 0)), (0.01, (1, 1, 0))])
def test_auto_runs_the_tree_the_costs_pick_with_greedy_output(
    auto_model, cache_dir, monkeypatch, extra_token_cost, tree
):
    model, tok = auto_model
    counting(monkeypatch, table(extra_token_cost))  # width 1 and the trees' widths
    hf_mars.measure(model, [1, 4], mars_verify=True)
    for batch in (1, 4):
        settings = hf_mars.mars_settings(model, None, batch, mars_verify=True)
        assert (settings["mars_block_size"], settings["mars_draft_candidates"], settings["mars_lookup"]) == tree
    enc = toy_prompts(tok, n=4, seed=13)
    reference = GenerationMixin.generate(model, **enc, do_sample=False, max_new_tokens=30)
    out = model.generate(**enc, mars_verify=True, max_new_tokens=30, return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference)
    tokens_per_forward = out.mars_stats.new_tokens.sum().item() / out.mars_stats.passes_per_row.sum().item()
    if tree == (1, 1, 0):  # no tree pays: plain decoding, one token per pass, still reported as MARS stats
        assert (
            tokens_per_forward == 1.0
            and out.mars_stats.forward_passes == reference.shape[1] - enc["input_ids"].shape[1]
        )
    else:
        assert tokens_per_forward > 1.0
    # A tree named in the call wins over the machine's choice
    named = hf_mars.mars_settings(model, mars_verify=True, mars_block_size=2, mars_draft_candidates=3)
    assert (named["mars_block_size"], named["mars_draft_candidates"]) == (2, 3)
    assert hf_mars.mars_settings(model, mars_tau=0.9)["mars_block_size"] == 4  # τ-mode: the model's own B


def test_auto_under_a_grammar_chooses_among_the_chains_measured(auto_model, cache_dir, monkeypatch):
    """A call whose logits processor keeps drafts a chain (a grammar reads its history) is not given a tree whose
    acceptance was measured as a tree: the costs that pick 4x3+8 unconstrained pick 2x1, the one chain measured."""
    from hf_mars.grammar import GrammarProcessor

    model, tok = auto_model
    counting(monkeypatch, table(0.0))
    hf_mars.measure(model, [1], mars_verify=True)
    grammar = GrammarProcessor.from_json_schema({"type": "object"}, tok)
    tree = ("mars_block_size", "mars_draft_candidates", "mars_lookup")
    free = hf_mars.mars_settings(model, None, 1, mars_verify=True)
    held = hf_mars.mars_settings(model, None, 1, mars_verify=True, logits_processor=[grammar])
    assert tuple(free[k] for k in tree) == (4, 3, 8)
    assert tuple(held[k] for k in tree) == (2, 1, 0)
    config = model.generation_config
    config.mars_acceptance = {"2x3+4": 2.1, "4x3+8": 2.6}  # no chain measured: plain decoding
    held = hf_mars.mars_settings(model, None, 1, mars_verify=True, logits_processor=[grammar])
    assert held["mars_block_size"] == 1


def test_auto_without_acceptance_or_with_bad_acceptance_is_refused(trained_toy, cache_dir, monkeypatch):
    model, tok = trained_toy
    counting(monkeypatch, table(0.0))
    config = model.generation_config
    config.mars_lossless = "auto"
    enc = toy_prompts(tok, n=1)
    try:
        with pytest.raises(ValueError, match="mars_acceptance.*hf-mars tune --save"):
            model.generate(**enc, mars_verify=True, max_new_tokens=4)
        for bad in ({"2x1": 0.5}, {"1x1": 1.5}, ["2x1"]):
            config.mars_acceptance = bad
            with pytest.raises(ValueError, match="mars_acceptance|BxN"):
                model.generate(**enc, mars_verify=True, max_new_tokens=4)
        del config.mars_lossless  # acceptance alone also means auto
        config.mars_acceptance = {"2x1": 1.7}
        assert hf_mars.measure(model, mars_verify=True)[1]["mars_block_size"] == 2  # a free wide pass: the tree pays
    finally:
        for name in ("mars_lossless", "mars_acceptance"):
            if hasattr(config, name):
                delattr(config, name)


def test_mask_cost_auto_is_read_from_the_same_pass_costs(trained_toy, cache_dir, monkeypatch):
    model, tok = trained_toy
    calls = counting(monkeypatch, {1: 0.010, 2: 0.012, 3: 0.015, 4: 0.020})
    settings = hf_mars.measure(model, mars_tau=0.9, mars_mask_cost="auto")[1]
    assert settings["mars_mask_cost"] == [0.2, 0.5, 1.0] and len(calls) == 1  # B = 4: 1, 2, 3 masks
    assert hf_mars.mars_settings(model, mars_tau=0.9, mars_block_size=2, mars_mask_cost="auto")["mars_mask_cost"] == [
        0.2
    ]
    assert len(calls) == 1  # cached
    enc = toy_prompts(tok, n=2, seed=5)
    out = model.generate(**enc, mars_tau=1.0, mars_mask_cost="auto", max_new_tokens=12)
    assert torch.equal(out, GenerationMixin.generate(model, **enc, do_sample=False, max_new_tokens=12))
    with pytest.raises(ValueError, match='"auto"'):
        model.generate(**enc, mars_tau=0.9, mars_mask_cost="fast", max_new_tokens=4)


def test_the_dtype_is_the_one_where_lossless_decoding_is_fastest(auto_model, cache_dir, monkeypatch):
    """bfloat16 reads half the bytes (a faster one-token pass) but may make wide passes costly (emulated): the choice
    weighs both, from the same pass costs, and says why."""
    model, _ = auto_model
    per_dtype = {
        torch.float32: table(0.0001),  # wide passes nearly free
        torch.bfloat16: {w: 0.008 + 0.004 * (w - 1) for w in WIDTHS},  # faster one-token pass, costly width
    }
    monkeypatch.setattr(
        passes, "measure_pass_costs", lambda m, b, widths, **_: {w: per_dtype[m.dtype][w] for w in widths}
    )
    monkeypatch.setattr(passes, "measure_overheads", lambda *a, **k: dict(plain_overhead=0.0, mars_overhead=0.0))
    monkeypatch.setattr(passes, "measure_prefill", lambda *a, **k: 0.0)  # the prompt's cost: the next test
    choice = hf_mars.choose_dtype(model)
    assert choice.dtype == torch.float32 and choice.fastest_plain == torch.bfloat16
    assert choice.lossless[torch.bfloat16][0] is None  # no tree pays in bfloat16 here
    assert "float32" in choice.reason() and "bfloat16" in choice.reason() and "no tree pays" in choice.reason()
    assert model.dtype == torch.float32  # the model itself is not converted
    per_dtype[torch.bfloat16] = {w: 0.008 for w in WIDTHS}  # native bfloat16: width free too
    assert dtypes.choose_dtype(model, batch_size=2).dtype == torch.bfloat16  # another batch size: measured anew


def test_a_dear_prompt_forward_counts_in_the_dtype_choice(auto_model, cache_dir, monkeypatch):
    """Where bfloat16 is emulated, its prompt's forward (the widest pass of a call) can cost more than its faster
    steps save: the choice weighs the call's prompt against its new tokens, and the prompt's cost is cached."""
    model, _ = auto_model
    step = {torch.float32: 0.010, torch.bfloat16: 0.008}  # bfloat16 steps faster; no tree pays in either
    tokens = passes.PREFILL_TOKENS  # the prompt measure_prefill times
    prompt = {torch.float32: 0.5 * tokens / 256, torch.bfloat16: 5.0 * tokens / 256}  # 0.5 s and 5 s per 256 tokens
    prefills = []
    monkeypatch.setattr(
        passes, "measure_pass_costs", lambda m, b, ws, **_: {w: step[m.dtype] + 0.01 * (w - 1) for w in ws}
    )
    monkeypatch.setattr(passes, "measure_overheads", lambda *a, **k: dict(plain_overhead=0.0, mars_overhead=0.0))
    monkeypatch.setattr(passes, "measure_prefill", lambda m, b: prefills.append(m.dtype) or prompt[m.dtype])
    chat = hf_mars.choose_dtype(model, prompt_tokens=16, new_tokens=1000)  # a short prompt, a long answer
    assert chat.dtype == torch.bfloat16 and chat.prefill[torch.bfloat16] == pytest.approx(5.0 * 16 / 256)
    assert chat.lossless[torch.bfloat16] == (None, pytest.approx(1000 / (5.0 * 16 / 256 + 1000 * 0.008)))
    summary = hf_mars.choose_dtype(model, prompt_tokens=1024, new_tokens=32)  # a long prompt, a short answer
    assert summary.dtype == torch.float32 and summary.fastest_plain == torch.float32
    assert "1024-token prompt, 32 new tokens" in summary.reason() and "prompt 20.0 s" in summary.reason()
    assert summary.prior is None and "not timed" not in summary.reason()
    assert prefills == [torch.float32, torch.bfloat16]  # measured once per dtype, then read from the cache
    assert all("prefill" in entry for entry in json.loads((cache_dir / "pass_costs.json").read_text()).values())


def test_a_tree_must_beat_another_dtype_s_plain_decoding_by_the_margin_too(auto_model, cache_dir, monkeypatch):
    """A tree's expected rate rests on tokens per forward measured on other prompts: float32 with a tree expected 5%
    faster than bfloat16's plain decoding is not chosen over it (it must promise `MARGIN` more, as against plain
    decoding in its own dtype); 20% faster is."""
    model, _ = auto_model
    monkeypatch.setattr(passes, "measure_prefill", lambda *a, **k: 0.0)
    for lead, expected in ((1.05, torch.bfloat16), (1.2, torch.float32)):
        # float32: every pass 10 ms, wide or narrow (its widest tree pays most); bfloat16: plain decoding that tree's
        # rate over `lead`, and width as dear as a pass a token (no tree pays)
        tree_rate = max(ACCEPTANCE.values()) / 0.010
        step = {torch.float32: {w: 0.010 for w in WIDTHS}, torch.bfloat16: {w: lead / tree_rate * w for w in WIDTHS}}
        timed = lambda m, b, ws, step=step, **_: {w: step[m.dtype][w] for w in ws}  # noqa: E731 - as patched below
        monkeypatch.setattr(passes, "measure_pass_costs", timed)
        (cache_dir / "pass_costs.json").unlink(missing_ok=True)
        choice = hf_mars.choose_dtype(model, prompt_tokens=16, new_tokens=256)
        assert choice.lossless[torch.float32][0] is not None and choice.lossless[torch.bfloat16][0] is None
        assert choice.dtype == expected, choice.reason()


def test_on_a_busy_machine_the_dtype_is_chosen_from_what_is_known_of_the_cpu(auto_model, cache_dir, monkeypatch):
    """Nothing is timed on a busy machine: every dtype is weighed by the prior of its kind, in the same units (one
    float32 one-token pass), and the reason says the costs were not timed. Emulated bfloat16 makes wide passes dear,
    native bfloat16 does not."""
    model, _ = auto_model
    calls = counting(monkeypatch)
    monkeypatch.setattr(passes, "busy_cores", lambda threads=None: 1)
    try:
        for flags, tree_in_bfloat16 in ((frozenset({"avx2"}), False), (frozenset({"avx512_bf16"}), True)):
            monkeypatch.setattr(cost_model, "cpu_flags", lambda flags=flags: flags)
            choice = hf_mars.choose_dtype(model, prompt_tokens=64, new_tokens=256)
            assert calls == [] and choice.prior is not None and "not timed" in choice.reason()
            assert (choice.lossless[torch.bfloat16][0] is not None) == tree_in_bfloat16
            margin = {d: cost_model.MARGIN if tree else 1.0 for d, (tree, _) in choice.lossless.items()}
            assert choice.dtype == max(choice.lossless, key=lambda d: choice.lossless[d][1] / margin[d])
            assert "against plain float32" in choice.reason() and "tokens/s" not in choice.reason()  # no seconds
    finally:
        passes._DECLINED.clear()


def test_real_prefill_measurement(cache_dir):
    model = hf_mars.to_mars(make_model("llama"), make_tokenizer(), block_size=2)
    assert 0.0 < passes.measure_prefill(model, 2, context=16) < 5.0
    costs = pass_costs(model, 1, [4], prefill=True)
    assert costs.prefill is not None and costs.prefill > 0.0


def test_a_compiled_call_chooses_from_the_costs_of_compiled_passes(auto_model, cache_dir, monkeypatch):
    """A call whose passes `generate()` compiles (a static cache; on a CPU a compile config told to compile) runs
    graph passes, whose costs are not the eager forward's: they are timed on compiled passes, cached apart, and the
    tree is chosen from them. Here eager width is dear (no tree pays) and compiled width free (the widest pays)."""
    model, tok = auto_model
    counting(monkeypatch, table(0.01))
    timed = []

    def measure(model, batch_size, trees, compile_config=None):
        timed.append((batch_size, tuple(trees), compile_config))
        return {1 if tree is None else pass_width(*tree): 0.010 for tree in trees}

    monkeypatch.setattr(passes, "measure_compiled_passes", measure)
    config = CompileConfig(backend="eager")
    config._compile_all_devices = True  # generate() compiles on GPUs only unless told
    compiled = dict(mars_verify=True, cache_implementation="static", compile_config=config)
    picked = hf_mars.measure(model, [1], **compiled)[1]
    assert (picked["mars_block_size"], picked["mars_draft_candidates"], picked["mars_lookup"]) == (4, 3, 8)
    # plain first, then the narrowest tree; the widest earns most, and at this flat cost 2x3+4 cannot beat it
    assert timed == [(1, (tree,), config) for tree in (None, (2, 1, 0), (4, 3, 8))]
    assert hf_mars.mars_settings(model, None, 1, **compiled) == picked and len(timed) == 3  # cached
    assert hf_mars.measure(model, [1], mars_verify=True)[1]["mars_block_size"] == 1  # eager: none pays
    static_only = hf_mars.mars_settings(model, None, 1, mars_verify=True, cache_implementation="static")
    assert static_only["mars_block_size"] == 1  # a CPU does not compile unless told
    keys = list(json.loads((cache_dir / "pass_costs.json").read_text()))
    assert sorted(keys) == sorted([machine_key(model, 1), machine_key(model, 1, compiled=True)])
    enc = toy_prompts(tok, n=2, seed=13)
    hf_mars.measure(model, [2], **compiled)
    out = model.generate(**enc, **compiled, max_new_tokens=20, return_dict_in_generate=True)
    reference = GenerationMixin.generate(model, **enc, do_sample=False, max_new_tokens=20)
    assert torch.equal(out.sequences, reference) and out.mars_stats.mean_tokens_per_forward > 1.0


def test_compiled_passes_are_timed_on_the_compiled_path(cache_dir):
    """`measure_compiled_passes` times plain compiled `generate()` per step and a tree's graph pass per pass."""
    tok = make_tokenizer()
    model = hf_mars.to_mars(make_model("llama"), tok, block_size=2)
    config = CompileConfig(backend="eager")
    config._compile_all_devices = True
    seconds = passes.measure_compiled_passes(model, 2, [None, (2, 1, 0)], config, new_tokens=6)
    assert set(seconds) == {1, pass_width(2, 1, 0)} and all(s > 0 for s in seconds.values())
    assert model.__dict__.get("_mars_graphs"), "the tree ran as graph passes"


@pytest.mark.parametrize(
    "curve",
    [lambda w: 0.010, lambda w: 0.010 + 0.0004 * w, lambda w: 0.010 * (1 + w / (w + 20)), lambda w: 0.004 * w],
    ids=["flat", "linear", "saturating", "steep"],
)
def test_compiled_costs_time_only_the_trees_that_could_win_and_choose_as_if_all_were_timed(
    cache_dir, monkeypatch, curve
):
    """Timing a compiled pass compiles it (seconds to a minute on a GPU, a graph per width): a tree whose tokens per
    forward over the cost of a narrower pass (which it cannot undercut) lose to the best timed so far is not timed,
    and the choice is the one a timing of every tree makes."""
    model = hf_mars.to_mars(make_model("llama"), make_tokenizer(), block_size=4)
    acceptance = {"2x1": 1.59, "2x3": 1.80, "3x2,2": 2.12, "2x3+4": 2.46, "2x2+6": 2.53, "3x2+4": 2.55}
    acceptance |= {"3x3+5": 2.71, "4x1+4": 2.48, "4x3,2,2": 2.33, "4x3+8": 2.94}  # the shipped checkpoint's
    trees = [parse_tree(name) for name in acceptance]
    timed = []

    def measure(model, batch_size, trees, compile_config=None):
        timed.extend(trees)
        return {w: 0.009 if w == 1 else curve(w) for w in (1 if t is None else pass_width(*t) for t in trees)}

    monkeypatch.setattr(passes, "measure_compiled_passes", measure)
    pruned = passes.compiled_pass_costs(model, 1, trees, acceptance=acceptance)
    every = Costs({w: 0.009 if w == 1 else curve(w) for w in pruned.forward})
    assert choose_tree(acceptance, pruned) == choose_tree(acceptance, every)
    assert timed[:2] == [None, (2, 1, 0)] and len(timed) == len(set(timed))
    widths = {pass_width(*tree) for tree in trees}
    assert len(timed) < len(widths) + 1 or curve(56) / curve(4) > 3, "only a steep curve needs every width"
    again = cost_model.compiled_pass_costs(model, 1, trees, acceptance=acceptance)  # read: cached, pruned
    assert again.forward == pruned.forward and len(timed) == len(set(timed))
    timed.clear()
    passes.compiled_pass_costs(model, 1, trees, refresh=True)  # no acceptance (hf-mars tune): every width
    assert len(timed) == len(widths) + 1


def test_resolving_settings_never_times_and_says_how_to_measure(auto_model, cache_dir, monkeypatch, caplog):
    """`generate()`, `mars_settings` and a session time nothing: `"auto"` settings not timed yet choose from what is
    known of this kind of device (`prior_costs`: lossless mode's tree, the masks' cost), with one warning per setting
    and batch size that names the explicit call, `hf_mars.measure`; after it, calls run the tree it chose."""
    model, tok = auto_model
    calls = counting(monkeypatch, table(0.0))
    monkeypatch.setattr(cost_model, "_WARNED", set())  # once per process: this test's warnings are new
    enc = toy_prompts(tok, n=2, seed=3)
    reference = GenerationMixin.generate(model, **enc, do_sample=False, max_new_tokens=12)
    prior = cost_model.prior_costs(model, 2, [*WIDTHS, 2, 3])
    with caplog.at_level("WARNING"):
        tree = hf_mars.mars_settings(model, None, 2, mars_verify=True)["mars_block_size"]
        assert tree == (choose_tree(ACCEPTANCE, prior) or (1,))[0]
        out = model.generate(**enc, mars_verify=True, max_new_tokens=12, return_dict_in_generate=True)
        masks = hf_mars.mars_settings(model, None, 2, mars_tau=0.9, mars_mask_cost="auto")["mars_mask_cost"]
        assert masks == cost_model.mask_shares(prior.forward, 4) and masks[0] > 0.0  # the prior's CPU: not free
        model.mars_session(enc.input_ids, attention_mask=enc.attention_mask, mars_verify=True, max_new_tokens=4)
    assert calls == [] and torch.equal(out.sequences, reference)
    warned = [r.getMessage() for r in caplog.records if "hf_mars.measure(model" in r.getMessage()]
    assert len(warned) == 2 and 'mars_lossless="auto"' in warned[0] and 'mars_mask_cost="auto"' in warned[1]
    assert hf_mars.measure(model, [2], mars_verify=True)[2]["mars_block_size"] == 4 and calls
    out = model.generate(**enc, mars_verify=True, max_new_tokens=12, return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference) and out.mars_stats.mean_tokens_per_forward > 1.0
