"""The `hf-mars` command line, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import auto_lossless_model, make_model, make_tokenizer, rows_invariant_linear

import hf_mars

F32 = ("--dtype", "float32")  # lossless mode's text is greedy generate()'s exactly in float32


def hf_mars_cli(*args):
    return subprocess.run([sys.executable, "-m", "hf_mars.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture
def checkpoint(tmp_path):
    tok = make_tokenizer()
    model = make_model("qwen2")
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    hf_mars.to_mars(model, tok, block_size=4)
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_generate_streams_and_compares_with_ar(checkpoint):
    result = hf_mars_cli(
        "generate", str(checkpoint), "--prompt", "hello", "--tau", "1.0", "--max-new-tokens", "12", *F32
    )
    assert result.returncode == 0, result.stderr
    assert "12 tokens in 12 forward passes: 1.00 tokens/forward" in result.stderr
    assert "output identical to AR: True" in result.stderr
    result = hf_mars_cli(
        "generate", str(checkpoint), "--prompt", "hello", "--tau", "0.3", "--max-new-tokens", "24", "--no-compare"
    )
    assert result.returncode == 0, result.stderr
    passes = int(result.stderr.split(" forward passes")[0].split()[-1])
    assert passes < 24 and "plain AR" not in result.stderr
    result = hf_mars_cli(
        "generate", str(checkpoint), "--prompt", "hello", "--tau", "0.3", "--max-new-tokens", "24", "--lossless", *F32
    )
    assert result.returncode == 0, result.stderr
    assert "MARS lossless τ=0.3" in result.stderr and "output identical to AR: True" in result.stderr
    result = hf_mars_cli(
        "generate",
        str(checkpoint),
        "--prompt",
        "hello",
        "--tau",
        "0.3",
        "--max-new-tokens",
        "24",
        "--lossless",
        "--mask-cost",
        "auto",
        *F32,
    )
    assert result.returncode == 0, result.stderr
    costs = result.stderr.split("mask cost [")[1].split("]")[0].split(", ")  # timed here, or the prior's: 3 numbers
    assert len(costs) == 3 and all(float(c) >= 0.0 for c in costs)  # what they are is a benchmark's to say
    assert "output identical to AR: True" in result.stderr
    result = hf_mars_cli(
        "generate",
        str(checkpoint),
        "--prompt",
        "hello",
        "--tau",
        "0.0",
        "--max-new-tokens",
        "24",
        "--lossless",
        "--block-size",
        "2",
        "--draft-candidates",
        "3",
        "--lookup",
        "4",
        *F32,
    )
    assert result.returncode == 0, result.stderr
    assert "block size 2, 3 draft candidates, lookup 4" in result.stderr
    assert "output identical to AR: True" in result.stderr


def test_generate_defaults_to_lossless_and_says_what_tau_costs(checkpoint):
    """A first run shows what MARS does well (the AR text, in fewer passes) and says plainly what τ < 1 costs."""
    result = hf_mars_cli("generate", str(checkpoint), "--prompt", "hello", "--max-new-tokens", "16")
    assert result.returncode == 0, result.stderr
    assert "[MARS lossless τ=0.0" in result.stderr
    chosen = result.stderr.split("[dtype ")[1].split(":")[0].split(",")[0]  # the fastest dtype here, and why
    assert chosen in ("float32", "bfloat16") and "expected lossless for a" in result.stderr
    if chosen == "float32":
        assert "output identical to AR: True]" in result.stderr
    else:  # exact up to bfloat16's rounding of near-ties, and said so where it parts
        said = result.stderr.split("output identical to AR: ")[1]
        assert said.startswith("True]") or said.startswith("False (bfloat16: a pass over several tokens"), said
    exact = hf_mars_cli("generate", str(checkpoint), "--prompt", "hello", "--max-new-tokens", "16", *F32)
    assert "[dtype " not in exact.stderr and "output identical to AR: True]" in exact.stderr
    typical = hf_mars_cli("generate", str(checkpoint), "--prompt", "hello", "--max-new-tokens", "16", "--typical")
    assert typical.returncode == 0 and "[MARS typical-acceptance τ=0.0" in typical.stderr
    assert "--tau 0.9" in result.stderr and "the text can change" in result.stderr
    assert "[MARS speed-up, median of 3 interleaved runs: against plain " in result.stderr  # each side 3 times
    result = hf_mars_cli("generate", str(checkpoint), "--prompt", "hello", "--tau", "0.9", "--max-new-tokens", "16")
    assert "[MARS τ=0.9" in result.stderr and "--tau 0.9" not in result.stderr  # τ-mode when asked, no note


def test_generate_runs_no_comparison_where_lossless_mode_is_plain_decoding(tmp_path):
    """Where `"auto"` finds no draft tree that pays (here: no tree gains a token per forward), lossless mode is plain
    `generate()` itself: the run says so instead of timing plain decoding against itself, and takes no more time."""
    model, tok = auto_lossless_model({"2x1": 1.0, "4x3+8": 1.0})
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    result = hf_mars_cli("generate", str(tmp_path / "ckpt"), "--prompt", "hello", "--max-new-tokens", "8", *F32)
    assert result.returncode == 0, result.stderr
    assert "block size 1," in result.stderr and "lossless mode ran plain generate() itself" in result.stderr
    assert "MARS speed-up" not in result.stderr and "plain AR generate()" not in result.stderr
    assert "8 tokens in 8 forward passes" in result.stderr


def test_generate_with_ordered_attention_keeps_the_ar_text_in_bfloat16(checkpoint):
    """`--attention ordered` loads MARS and plain AR alike with it: lossless mode with a draft tree, in bfloat16,
    then gives the AR text (where this CPU's bfloat16 linear layers are row-invariant, which the run checks)."""
    if not rows_invariant_linear(torch.bfloat16):
        pytest.skip("this CPU's bfloat16 matrix kernels round a row by the rows beside it")
    args = ("--prompt", "hello", "--max-new-tokens", "24", "--lossless", "--tau", "0.0", "--dtype", "bfloat16")
    result = hf_mars_cli("generate", str(checkpoint), *args, "--draft-candidates", "3", "--attention", "ordered")
    assert result.returncode == 0, result.stderr
    assert "3 draft candidates" in result.stderr and "output identical to AR: True]" in result.stderr


def test_generate_samples_both_sides_from_the_seed(checkpoint):
    """`--temperature` samples MARS and plain AR alike, each from `--seed`: the run says how it sampled, claims no
    identity of drawn texts, and the same seed streams the same text again."""
    sampled = ("--prompt", "hello", "--max-new-tokens", "16", "--temperature", "0.7", "--top-p", "0.9", *F32)
    first = hf_mars_cli("generate", str(checkpoint), *sampled, "--repetition-penalty", "1.2", "--seed", "3")
    assert first.returncode == 0, first.stderr
    assert "[MARS lossless τ=0.0" in first.stderr
    assert "sampled at T = 0.7, top-p 0.9, repetition penalty 1.2]" in first.stderr
    assert "sampled: each side draws its own text (this mode's is distributed" in first.stderr
    assert "output identical to AR" not in first.stderr
    again = hf_mars_cli("generate", str(checkpoint), *sampled, "--repetition-penalty", "1.2", "--seed", "3")
    assert again.stdout == first.stdout and first.stdout.strip()
    tau = hf_mars_cli("generate", str(checkpoint), *sampled, "--tau", "0.5", "--no-compare")
    assert tau.returncode == 0 and "[MARS τ=0.5" in tau.stderr and "plain AR" not in tau.stderr


def test_cli_refuses_bad_input(checkpoint, tmp_path):
    assert "--tau must be in [0, 1]" in hf_mars_cli("generate", str(checkpoint), "--prompt", "x", "--tau", "2").stderr
    assert "a number >= 0 or `auto`" in hf_mars_cli("generate", str(checkpoint), "--mask-cost", "cheap").stderr
    tau_mode = hf_mars_cli("generate", str(checkpoint), "--prompt", "x", "--tau", "0.9", "--lookup", "4")
    assert "add --lossless" in tau_mode.stderr
    typical = hf_mars_cli("generate", str(checkpoint), "--prompt", "x", "--tau", "0.9", "--typical")
    assert "--typical verifies lossless mode's drafts" in typical.stderr
    assert "BxN or BxN+L" in hf_mars_cli("bench", str(checkpoint), "--lossless-trees", "2x3+x").stderr
    assert "local checkpoint folder" in hf_mars_cli("tune", "no-such-org/no-such-repo", "--save").stderr
    make_model("llama").save_pretrained(tmp_path / "plain")
    make_tokenizer().save_pretrained(tmp_path / "plain")
    assert "not a MARS checkpoint" in hf_mars_cli("generate", str(tmp_path / "plain"), "--prompt", "x").stderr
    assert "omit it for greedy" in hf_mars_cli("generate", str(checkpoint), "--temperature", "0").stderr
    assert "comes with --temperature" in hf_mars_cli("generate", str(checkpoint), "--top-p", "0.9").stderr
    assert "not a MARS" in hf_mars_cli("convert", str(tmp_path / "plain"), str(tmp_path / "out")).stderr


def test_bench_measures_the_mask_cost_once_and_uses_it(checkpoint, tmp_path):
    import json

    out = tmp_path / "bench"
    result = hf_mars_cli(
        "bench",
        str(checkpoint),
        "--prompts",
        "toy",
        "--limit",
        "2",
        "--batch-sizes",
        "1",
        "--taus",
        "1.0",
        "0.5",
        "--max-new-tokens",
        "6",
        "--repeats",
        "1",
        "--prompt-lookup",
        "0",
        "--lossless-trees",
        "2x3+4",
        "--output",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    data = json.loads((out / "bench.json").read_text())
    costs = data["meta"]["mask_cost"]["1"]  # batch size 1: what 1, 2, 3 masks add to a one-token pass
    assert len(costs) == 3 and all(c >= 0 for c in costs)
    methods = {cell["method"] for cell in data["cells"]}
    assert {
        "mars tau=0.5",
        "mars cost=auto tau=0.5",
        "lossless cost=auto tau=0.5",
        "lossless 2x3+4 tau=0.5",
    } <= methods
    assert "mars_mask_cost measured here" in result.stdout
    against = next(line for line in result.stdout.splitlines() if line.startswith("batch 1: plain "))
    assert "fastest lossless lossless " in against and "fastest of all " in against  # exact rows named apart


def test_tune_picks_a_draft_tree_and_saves_it_for_lossless_generate(checkpoint):
    import ast
    import json

    result = hf_mars_cli(
        "tune",
        str(checkpoint),
        "--prompts",
        "toy",
        "--limit",
        "2",
        "--max-new-tokens",
        "8",
        "--trees",
        "2x1",
        "2x3+4",
        "--save",
    )
    assert result.returncode == 0, result.stderr
    for name in ("ar", "lossless tau=0.0", "lossless 2x1 tau=0.0", "lossless 2x3+4 tau=0.0"):
        assert f"\n{name} " in result.stdout
    assert "mars tau=" not in result.stdout  # τ-mode is not what tune measures
    saved = json.loads((checkpoint / "generation_config.json").read_text())["mars_lossless"]["1"]  # batch 1 and up
    trees = [(4, 1, 0), (2, 1, 0), (2, 3, 4)]  # the checkpoint's default (B = 4 chain), then --trees
    tree = (saved["mars_block_size"], saved["mars_draft_candidates"], saved["mars_lookup"])
    assert saved["mars_tau"] == 0.0 and tree in trees
    assert ast.literal_eval(result.stdout.split("mars_lossless = ")[1].split("\n")[0]) == saved  # printed = saved
    # generate --lossless now runs the saved tree, still with AR's text
    result = hf_mars_cli(
        "generate", str(checkpoint), "--prompt", "hello", "--max-new-tokens", "16", "--lossless", *F32
    )
    assert result.returncode == 0, result.stderr
    assert f"block size {tree[0]}, {tree[1]} draft candidates, lookup {tree[2]}" in result.stderr
    assert "MARS lossless τ=0.0" in result.stderr and "output identical to AR: True" in result.stderr
    # --mask-cost auto measures the model's B (4) and keeps what the saved tree's B uses
    result = hf_mars_cli(
        "generate",
        str(checkpoint),
        "--prompt",
        "hello",
        "--max-new-tokens",
        "8",
        "--lossless",
        "--mask-cost",
        "auto",
        "--no-compare",
    )
    assert result.returncode == 0, result.stderr
    assert len(result.stderr.split("mask cost [")[1].split("]")[0].split(", ")) == tree[0] - 1
    # Tuning another batch size adds its entry and keeps batch 1's
    result = hf_mars_cli(
        "tune",
        str(checkpoint),
        "--prompts",
        "toy",
        "--limit",
        "4",
        "--max-new-tokens",
        "6",
        "--trees",
        "2x1",
        "--batch-size",
        "2",
        "--save",
    )
    assert result.returncode == 0, result.stderr
    entries = json.loads((checkpoint / "generation_config.json").read_text())["mars_lossless"]
    assert set(entries) == {"1", "2"} and entries["1"] == saved and "batch 2" in result.stdout


def test_tune_compile_times_trees_on_the_compiled_path_and_reports_compiled_costs(
    checkpoint, tmp_path, monkeypatch, capsys
):
    """`hf-mars tune --compile` tunes as a GPU server decodes: a static cache and generate()'s compile path (torch's
    eager backend here, so that compiling takes seconds), and the costs it reports, from which `"auto"` would choose
    there, are compiled passes' (a plain compiled step for width 1), cached apart from eager forwards'."""
    import functools
    import json

    import transformers

    from hf_mars.cli import build_parser

    monkeypatch.setattr(transformers, "CompileConfig", functools.partial(transformers.CompileConfig, backend="eager"))
    monkeypatch.setenv("HF_MARS_CACHE", str(tmp_path / "cache"))
    argv = ["tune", str(checkpoint), "--prompts", "toy", "--limit", "2", "--max-new-tokens", "6", "--trees", "2x1"]
    args = build_parser().parse_args([*argv, "--compile"])
    args.run(args)
    out = capsys.readouterr().out
    assert "static cache, compiled, batch 1" in out and "a compiled plain step" in out
    assert "| 2x1 | 4 |" in out and 'mars_lossless="auto" would run:' in out
    table = json.loads((tmp_path / "cache" / "pass_costs.json").read_text())
    assert list(table) == [next(key for key in table if key.endswith("| compiled passes"))]  # no eager forwards
    assert set(table[next(iter(table))]["forward"]) == {"1", "4"}  # a plain compiled step, the 2x1 tree's pass
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert float(rows["2x1"].split(" | ")[3].rstrip("x")) > 0  # its graph pass against the plain step


def test_bench_names_the_tree_a_compiled_run_chose_from_compiled_costs(tmp_path, monkeypatch):
    """`hf-mars bench --compile` says which tree `"auto"` ran at each batch size: read from the compiled pass costs
    the runs chose from, never by timing the eager path (which a compiled run never takes)."""
    from hf_mars.cli.bench import _lossless_trees
    from hf_mars.decoding import costs
    from hf_mars.tools.measure import passes
    from hf_mars.tools.measure.decode import compiled_path

    monkeypatch.setenv("HF_MARS_CACHE", str(tmp_path / "cache"))
    model, _ = auto_lossless_model()

    def eager(*args, **kwargs):
        raise AssertionError("a compiled run's tree must not be chosen from eager timings")

    def flat(model, batch, trees, compile_config=None):  # every compiled pass costs a plain step: the widest wins
        return {1 if tree is None else costs.pass_width(*tree): 0.01 for tree in trees}

    monkeypatch.setattr(passes, "measure_pass_costs", eager)
    monkeypatch.setattr(passes, "measure_compiled_passes", flat)
    passes.measure(model, [1], mars_verify=True, **compiled_path(model))  # what the bench's runs do first
    assert _lossless_trees(model, [1], compiled=True).endswith("batch 1: 4x3+8")


def test_serve_takes_its_api_key_from_the_environment_unless_given(monkeypatch):
    """HF_MARS_API_KEY keeps the key out of the process list; `--api-key` wins over it."""
    import argparse

    from hf_mars.cli import serve

    def parse(*args):
        parser = argparse.ArgumentParser()
        serve.add_parser(parser.add_subparsers())
        return parser.parse_args(["serve", *args]).api_key

    monkeypatch.delenv("HF_MARS_API_KEY", raising=False)
    assert parse() is None
    monkeypatch.setenv("HF_MARS_API_KEY", "from-env")
    assert parse() == "from-env" and parse("--api-key", "given") == "given"


def test_the_comparison_reports_medians_with_their_spread_and_says_what_makes_them_mean_less():
    """`hf-mars generate`'s figures, from given rates (the timings themselves are a benchmark's): the median of the
    rounds' ratios with their range; a busy machine, a wide spread and one token a pass are each said."""
    from types import SimpleNamespace

    from hf_mars.cli.generate import SPREAD, _caveats, _spread
    from hf_mars.tools.measure.cpu_load import BUSY_SHARE

    assert _spread([1.2, 1.0, 1.1]) == "1.10x (1.00x to 1.20x)" and _spread([1.3]) == "1.30x"
    drafting = SimpleNamespace(forward_passes=10, mean_tokens_per_forward=1.8)
    assert _caveats(drafting, [1.0, 1.05, 1.1], 0.95) == []
    busy = _caveats(drafting, [1.0, 1.05, 1.1], BUSY_SHARE / 2)
    assert len(busy) == 1 and "noise" in busy[0] and f"{100 * BUSY_SHARE / 2:.0f}%" in busy[0]
    wide = _caveats(drafting, [1.0, 1.0 + 2 * SPREAD, 1.1], 0.95)
    assert len(wide) == 1 and "rough" in wide[0]
    plain = _caveats(SimpleNamespace(forward_passes=10, mean_tokens_per_forward=1.0), [0.97, 0.99, 1.01], 0.95)
    assert len(plain) == 1 and "one token a pass" in plain[0]
