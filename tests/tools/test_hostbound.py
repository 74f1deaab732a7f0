"""`hf-mars bench --host-bound`: ms per MARS pass against ms per plain step on the host-bound CPU proxy."""

from __future__ import annotations

import subprocess
import sys

from hf_mars.tools.measure import hostbound
from hf_mars.tools.measure.hostbound import MODES, format_pass_costs, forward_costs, host_bound_model, pass_costs


def test_pass_costs_time_every_mode_against_a_plain_step():
    model, tokenizer = host_bound_model(layers=2, hidden=32)
    rows = pass_costs(model, tokenizer, batch_sizes=(1, 2), max_new_tokens=6, repeats=1)
    assert [(r["batch"], r["method"]) for r in rows] == [(b, m) for b in (1, 2) for m in ("plain generate()", *MODES)]
    assert all(r["ms"] > 0 for r in rows)
    assert [r["ratio"] for r in rows if r["method"] == "plain generate()"] == [1.0, 1.0]
    table = format_pass_costs(rows)
    assert table.count("\n") == len(rows) + 1 and "| 2 | lossless |" in table


def test_cli_host_bound_prints_the_proxy_table():
    command = [sys.executable, "-m", "hf_mars.cli", "bench", "--host-bound", "--batch-sizes", "1"]
    result = subprocess.run(
        [*command, "--max-new-tokens", "4", "--repeats", "1"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "30 layers, hidden 64" in result.stdout and "| 1 | MARS τ = 0.9 |" in result.stdout
    assert "batch 1: 1 tokens" in result.stdout and "7 tokens" in result.stdout  # the forward alone, per width
    assert "| greedy, default call | 1 | MARS τ = 1 |" in result.stdout  # the default call too


def test_forward_costs_time_each_width_with_the_mask_a_pass_builds():
    model, _ = host_bound_model(layers=2, hidden=32)
    costs = forward_costs(model, batch=2, widths=(1, 3), repeats=3)
    assert set(costs) == {1, 3} and all(ms > 0 for ms in costs.values())


def test_compiled_pass_costs_compile_one_graph_per_mode(monkeypatch):
    """`--host-bound --compile`: a static cache and generate()'s compile path for plain decoding and every MARS mode;
    each compiles one graph in its untimed first run, and the timed runs add none (the eager dynamo backend keeps
    the test fast; it guards and recompiles as inductor does)."""
    import functools

    import torch
    import transformers
    from torch._dynamo.utils import counters

    monkeypatch.setattr(transformers, "CompileConfig", functools.partial(transformers.CompileConfig, backend="eager"))
    # The mode with a measured mask cost gets a fixed one: a busy machine can measure masks as free, and a cost of 0
    # makes that mode's pass τ = 0.9's own (one graph fewer), which is not what this test counts
    monkeypatch.setattr(hostbound, "auto_mask_cost", lambda *args, **kwargs: [0.2, 0.4, 0.6])
    model, tokenizer = host_bound_model(layers=2, hidden=32)
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    rows = pass_costs(model, tokenizer, batch_sizes=(1,), max_new_tokens=6, repeats=2, compiled=True)
    # plain's forward; τ = 1, τ = 0.9, τ = 0.9 with the measured mask cost (its schedule in the pass), lossless and
    # lossless with lookup each one whole pass (graph.py). Nothing compiles again in the timed repeats: one static
    # cache holds every mode's passes.
    assert counters["stats"]["unique_graphs"] - before == 1 + 5
    methods = [r["method"] for r in rows]
    assert sorted(methods) == sorted(["plain generate()", *MODES]) and all(r["ms"] > 0 for r in rows)
