"""The measurement scripts under examples/ run, on a saved toy MARS checkpoint, and report what they promise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import rows_invariant_linear

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def toy_folder(trained_toy, tmp_path_factory):
    model, tok = trained_toy
    folder = tmp_path_factory.mktemp("toy-checkpoint")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_check_numerics_counts_no_difference_in_float32(toy_folder):
    out = run("check_numerics.py", toy_folder, "--dtypes", "float32", "--prompts", "2", "--max-new-tokens", "12")
    line = next(line for line in out.splitlines() if line.startswith("float32:"))
    differ, total = (int(word) for word in line.split("at ")[1].split(" positions")[0].split(" of "))
    assert total > 0 and differ == 0, line


def test_check_exactness_counts_rows_equal_to_plain_greedy_per_attention(toy_folder):
    """With `ordered` attention every row of every mode equals plain greedy's in bfloat16, on both caches (on a CPU
    whose linear layers are row-invariant, as the attention's own tests say), and the cost line sets it against
    `sdpa`."""
    if not rows_invariant_linear(torch.bfloat16):
        pytest.skip("this CPU's bfloat16 matrix kernels round a row by the rows beside it, padded or not")
    out = run(
        "check_exactness.py",
        toy_folder,
        "--attention",
        "sdpa",
        "ordered",
        "--prompts",
        "4",
        "--max-new-tokens",
        "12",
        "--caches",
        "dynamic",
        "static",
        "--cost-rounds",
        "1",
    )
    for cache in ("dynamic", "static"):
        line = next(line for line in out.splitlines() if line.startswith(f"ordered (bfloat16, {cache} cache): "))
        counts = [part.split(" (")[0].rsplit(" ", 1)[1] for part in line.split(": ", 1)[1].split("; ")]
        assert len(counts) == 5 and set(counts) == {"4/4"}, line  # a tree and τ = 1 at batch 1 and 4, plain batched
    assert out.count("plain generate(), batch ") == 2 and "sdpa" in out and "1.00x" in out


PHASES = ("forward", "inputs", "accept", "commit", "propose", "compact", "host")


def test_profile_decoding_splits_the_pass_and_lists_operators(toy_folder):
    out = run(
        "profile_decoding.py", toy_folder, "--tau", "0.5", "--prompts", "2", "--max-new-tokens", "12", "--ops", "5"
    )
    shares = {
        line.split()[0]: float(line.rsplit(None, 1)[1].rstrip("%"))
        for line in out.splitlines()
        if line.strip().startswith(PHASES)
    }
    assert set(shares) == set(PHASES)
    assert abs(sum(shares.values()) - 100) < 1
    assert "aten::" in out and "Self CPU" in out


def test_check_numerics_names_where_a_wide_pass_parts_from_a_one_token_pass(toy_folder):
    same = run("check_numerics.py", toy_folder, "--dtypes", "float32", "--first-difference", "--width", "1")
    assert "float32: no module's output differs between a 1-token and a 1-token pass" in same  # no false alarm
    wide = run(
        "check_numerics.py", toy_folder, "--dtypes", "float32", "bfloat16", "--first-difference", "--width", "8"
    )
    for dtype in ("float32", "bfloat16"):
        line = next(line for line in wide.splitlines() if line.startswith(f"{dtype}:"))
        assert "first difference at model." in line or "no module's output differs" in line, line


def test_bench_graph_pass_times_each_variant_of_the_graph_pass_against_a_plain_step():
    methods = ["--methods", "τ = 0.9", "lossless 4x3+8", "--variants", "graph", "fused"]
    quick = ["--device", "cpu", "--dtype", "float32", "--layers", "1", "--batch-sizes", "2", "--eager"]
    out = run("bench_graph_pass.py", *quick, "--new-tokens", "6", "--repeats", "1", "--profile", "3", *methods)
    profiled = out[out.index("device busy ms per pass") :].splitlines()[2:7]
    assert [row.split(" | ")[0].lstrip("| ") for row in profiled][1:] == [
        f"{m}, {v}" for m in ("τ = 0.9", "lossless 4x3+8") for v in ("graph", "fused")
    ]
    assert all(float(row.split(" | ")[2]) > 0 and int(row.split(" | ")[3].rstrip(" |")) > 0 for row in profiled)
    assert out.count("costliest kernels") == 5
    assert out.count("against τ = 0.9, graph: calls per pass that differ") == 3
    wide = out[out.index("lossless 4x3+8, graph against τ = 0.9, graph") :].splitlines()[1:4]
    assert all(line.split()[0][0] in "+-" for line in wide), wide  # a wider pass launches other kernels
    rows = [line for line in out.splitlines() if line.startswith("| ") and "x |" in line]
    names = [row.split(" | ")[0].lstrip("| ") for row in rows]
    assert names == ["plain generate()"] + [
        f"{m}, {v}" for m in ("τ = 0.9", "lossless 4x3+8") for v in ("graph", "fused")
    ]
    assert rows[0].endswith("| 1.00x |") and all(float(row.split(" | ")[1]) > 0 for row in rows)


def test_bench_graph_pass_sets_a_sampled_method_against_a_sampled_plain_step():
    quick = ["--device", "cpu", "--dtype", "float32", "--layers", "1", "--batch-sizes", "2", "--eager"]
    out = run("bench_graph_pass.py", *quick, "--new-tokens", "6", "--repeats", "1", "--methods", "sampled τ = 0.9")
    rows = [line for line in out.splitlines() if line.startswith("| ") and "x |" in line]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == [
        "plain generate()",
        "plain generate(), sampled",
        "sampled τ = 0.9, graph",
    ]
    assert all(row.endswith("| 1.00x |") for row in rows[:2])


def test_bench_graph_pass_splits_a_run_into_a_fixed_cost_and_a_steady_pass_cost():
    quick = ["--device", "cpu", "--dtype", "float32", "--layers", "1", "--batch-sizes", "1", "--eager", "--one-config"]
    lengths = ["--new-tokens", "12", "--short", "4"]
    out = run("bench_graph_pass.py", *quick, *lengths, "--repeats", "1", "--methods", "τ = 1")
    assert "warm-up batch 1: τ = 1, graph (4 tokens)" in out
    steady = out[out.index("| fixed ms a run |") :].splitlines()[2:]
    rows = [row.strip("| ").split(" | ") for row in steady if row.startswith("| ")]
    assert [row[0] for row in rows] == ["plain generate()", "τ = 1, graph"]
    assert all(isinstance(float(fixed) + float(steady), float) for _, fixed, steady, _ in rows)  # numbers, any sign
    assert rows[0][3] == "1.00x"  # plain against itself: what a run measures is a benchmark's, not this test's


def test_a_run_splits_into_a_fixed_cost_and_a_steady_cost_a_pass_by_two_lengths():
    """The split's arithmetic (the timings themselves are the benchmark's): 10 ms a run and 2 ms a pass, read back
    from a 12-pass and a 4-pass run."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from bench_graph_pass import split_run
    finally:
        sys.path.remove(str(ROOT / "examples"))
    fixed, steady = split_run((0.010 + 12 * 0.002, 12), (0.010 + 4 * 0.002, 4))
    assert fixed == pytest.approx(0.010) and steady == pytest.approx(0.002)
    assert split_run((0.5, 4), (0.5, 4)) == (0.5, 0.0)  # equal lengths: no slope to read, all of it fixed


def test_check_sampled_capture_finds_the_graph_pass_drawing_the_eager_passs_tokens():
    """Off CUDA nothing is captured: both runs are eager, and must draw alike, seed for seed."""
    out = run("check_sampled_capture.py", "--device", "cpu", "--layers", "2")
    lines = [line for line in out.splitlines() if line.startswith("sampled")]
    assert len(lines) == 3 and all("captured = eager on 100.0% of tokens" in line for line in lines), out
    assert all("repeats it: True" in line and "another seed differs: True" in line for line in lines), out


def test_simulate_tau_policy_lowers_tau_only_where_the_recorded_costs_say_it_pays(tmp_path):
    """On a pass as wide at any τ (a graph pass) the load alone lowers τ; where the wide pass costs twice a one-token
    pass, τ = 0.8's tokens do not pay and τ stays 1; with one row and nothing waiting, τ is the range's highest."""
    import json

    data = {
        "tokens_per_forward": {"by_tau": {"1.0": 1.0, "0.8": 1.5}},
        "machines": {
            "wide": {"widens": False, "costs": {n: {"one": 0.002, "wide": 0.002, "plain": 0.003} for n in "14"}},
            "dear": {"widens": True, "costs": {n: {"one": 0.01, "wide": 0.02, "plain": 0.01} for n in "14"}},
        },
    }
    (tmp_path / "costs.json").write_text(json.dumps(data))
    out = run("simulate_tau_policy.py", "--data", str(tmp_path / "costs.json"), "--capacity", "4")
    rows = {}
    for name, table in zip(("wide", "dear"), out.split("\n\n")[1::2]):
        rows[name] = [line.split(" | ")[:5] for line in table.splitlines()[2:]]
    # (rows, waiting): (1, 0) is idle; (1, 1), (4, 0) and (4, 4) are load 1 in a batch of 4
    assert [r[2] for r in rows["wide"]] == ["1", "0.8", "0.8", "0.8"] and rows["wide"][2][4] == "1.50x"
    assert [r[2] for r in rows["dear"]] == ["1", "1", "1", "1"] and rows["dear"][2][4] == "1.00x"


def test_agent_client_gets_json_a_tool_call_log_probabilities_and_choices_from_the_server(tmp_path):
    """examples/agent_client.py against `hf-mars serve` on a random MARS checkpoint (its schemas bound every output,
    so even a random model's ends within the budget): its JSON validates against the example's schema, its tool
    call names the forced function with arguments of its parameters, every token's probability and its
    alternatives' are in (0, 1], three choices, usage counting them."""
    import json

    import jsonschema
    from helpers import make_model, make_tokenizer, serving

    from hf_mars import to_mars
    from hf_mars.serving.server import build_app

    tok, model = make_tokenizer(), make_model("llama")
    to_mars(model, tok, block_size=4)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    app, _ = build_app(str(tmp_path), dtype="float32", device="cpu", max_batch_size=4)
    with serving(app) as url:
        out = run("agent_client.py", "--url", url + "/v1", "--max-tokens", "400")
    lines = out.splitlines()
    spec = {}
    exec(compile((ROOT / "examples" / "agent_client.py").read_text(), "agent_client", "exec"), spec)
    text = next(line for line in lines if line.startswith("json: ")).removeprefix("json: ")
    jsonschema.validate(json.loads(text), spec["PERSON"])
    name, arguments = next(line for line in lines if line.startswith("tool: ")).split(" ", 2)[1:]
    parameters = spec["WEATHER"]["function"]["parameters"]
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), {**parameters, "additionalProperties": False})
    probabilities = [float(line.split(" p=")[1].split(" ")[0]) for line in lines if line.startswith("logprob: ")]
    assert probabilities and all(0 < p <= 1 for p in probabilities)
    assert [line.split(":")[0] for line in lines if line.startswith("choice ")] == ["choice 0", "choice 1", "choice 2"]
    assert "'forward_passes'" in next(line for line in lines if line.startswith("usage: "))


def test_serve_mixed_load_reports_plain_latency_alone_and_beside_schema_requests(tmp_path):
    """examples/serve_mixed_load.py on a random MARS checkpoint, two clients of each kind (a plain one sends two
    requests in turn), one round, on the server's eager runner: both lines of plain latency over the requests sent,
    and the schema requests' validity counted over all of them."""
    from helpers import make_model, make_tokenizer

    from hf_mars import to_mars

    tok, model = make_tokenizer(), make_model("llama")
    to_mars(model, tok, block_size=4)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    out = run(
        "serve_mixed_load.py",
        str(tmp_path),
        "--clients",
        "2",
        "--max-tokens",
        "8",
        "--rounds",
        "1",
        "--cache-slots",
        "256",
    )
    lines = out.splitlines()
    for name in ("alone", "beside schema requests"):
        line = next(line for line in lines if line.startswith(f"plain {name}: "))
        assert line.endswith("(4 requests)") and float(line.split("request p50 ")[1].split(" s")[0]) > 0
    valid, total = next(line for line in lines if line.startswith("schema outputs valid: ")).split(": ")[1].split("/")
    assert int(total) == 2 and 0 <= int(valid) <= 2
