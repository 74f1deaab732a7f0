"""`hf-mars eval` (tools/evaluate/evals.py): per τ, tokens per forward, the shares of answers identical to τ = 1's
and to the base model's, GSM8K / HumanEval accuracy, as one table (Markdown, JSON) and a plot (PNG); on a tiny
model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import make_model, make_tokenizer

import hf_mars
from hf_mars.tools.evaluate.evals import format_tau_table, save_tau_plot, tau_table

COLUMNS = ["setting", "tokens/forward", "same as τ = 1", "same as base", "GSM8K acc.", "HumanEval pass@1"]
PNG = b"\x89PNG\r\n\x1a\n"


def sharp_mars(max_positions: int = 512):
    """A tiny MARS model with peaked distributions: low τ accepts several tokens per pass."""
    tok = make_tokenizer()
    model = make_model("qwen2", max_position_embeddings=max_positions)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return hf_mars.to_mars(model, tok, block_size=4).eval(), tok


# A HumanEval-shaped problem that the harness executes: solved by `def one(): return 1`, failed by anything else.
PROBLEM = {
    "task_id": "Toy/0",
    "prompt": 'def one():\n    """Return one."""\n',
    "entry_point": "one",
    "test": "def check(candidate):\n    assert candidate() == 1\n",
}
ROWS = [
    {"prompt": "Count: 1 2 3", "answer": "4", "task": "gsm8k"},
    {"prompt": "What is 2 + 2?", "answer": "4", "task": "gsm8k"},
    {"prompt": "Write one().", "task": "humaneval", "problem": PROBLEM},
]


def rows_of(table):
    lines = table.splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return cells[0], cells[2:]


def test_tau_table_is_consistent_and_drawn(tmp_path):
    model, tok = sharp_mars()
    # The base model is the MARS model decoded by plain generate(): τ = 1 must give its answers, token for token
    table = tau_table(model, tok, ROWS, taus=(0.0, 1.0), base_model=model, batch_size=2, max_new_tokens=12)
    base, tau1, tau0 = table
    assert [row["tau"] for row in table] == [None, 1.0, 0.0]
    assert tau1["tokens_per_forward"] == 1.0 and tau1["same_as_tau1"] == 100.0 and tau1["same_as_base"] == 100.0
    assert all(tau1[task] == base[task] for task in ("gsm8k", "humaneval"))  # same answers, same scores
    assert tau0["tokens_per_forward"] > 1.5  # every mask accepted
    per_task = [tau0["tokens_per_forward_gsm8k"], tau0["tokens_per_forward_humaneval"]]
    assert min(per_task) <= tau0["tokens_per_forward"] <= max(per_task)  # the mean over both sets' tokens
    assert tau1["tokens_per_forward_gsm8k"] == tau1["tokens_per_forward_humaneval"] == 1.0
    assert [len(row["answers"]) for row in table] == [len(ROWS)] * 3 and tau1["answers"] == base["answers"]
    assert tau0["same_as_tau1"] == tau0["same_as_base"] < 100.0  # the masks' guesses change the text

    head, body = rows_of(format_tau_table(table))
    assert head == COLUMNS
    assert [r[0] for r in body] == ["base model, generate()", "MARS τ=1.0", "MARS τ=0.0"]
    assert body[1][1:4] == ["1.00", "100%", "100%"] and body[0][2] == ""  # the base has no τ = 1 to agree with
    assert body[2][1] == f"{tau0['tokens_per_forward']:.2f}"

    png = save_tau_plot(table, tmp_path / "eval.png", title="tiny")
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 10_000  # a drawn figure, not an empty file


def test_the_harness_scores_humaneval_answers():
    """The HumanEval column counts executed, passing code: a right answer passes, a wrong one fails."""
    from hf_mars.tools.evaluate.evals import humaneval_correct

    assert humaneval_correct("```python\ndef one():\n    return 1\n```", PROBLEM)
    assert not humaneval_correct("```python\ndef one():\n    return 2\n```", PROBLEM)


def test_without_tau_one_or_base_the_agreement_columns_are_blank():
    model, tok = sharp_mars()
    table = tau_table(model, tok, ROWS[:2], taus=(0.5,), batch_size=2, max_new_tokens=6)
    assert table[0]["same_as_tau1"] is None and table[0]["same_as_base"] is None
    head, body = rows_of(format_tau_table(table))
    assert head == ["setting", "tokens/forward", "same as τ = 1", "GSM8K acc."]  # no base: no base column
    assert body[0][2] == ""


@pytest.mark.slow
def test_cli_eval_writes_the_table_json_and_plot(tmp_path):
    """`hf-mars eval MODEL` on the first GSM8K and HumanEval problems, as a user runs it."""
    model, tok = sharp_mars(max_positions=2048)  # byte-level tokens: a HumanEval prompt is ~700 of them
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "out"
    args = ["eval", str(tmp_path / "ckpt"), "--gsm8k", "2", "--humaneval", "1", "--taus", "1.0", "0.0"]
    args += ["--max-new-tokens", "8", "--batch-size", "2", "--output", str(out)]
    result = subprocess.run([sys.executable, "-m", "hf_mars.cli", *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    head, body = rows_of((out / "eval.md").read_text())
    assert head == [c for c in COLUMNS if c != "same as base"] and len(body) == 2
    assert (out / "eval.md").read_text().strip() in result.stdout  # printed = written
    data = json.loads((out / "eval.json").read_text())
    assert data["meta"]["gsm8k"] == 2 and data["meta"]["humaneval"] == 1
    tau1, tau0 = data["rows"]
    assert "answers" not in tau1 and [len(a) for a in data["answers"].values()] == [3, 3]  # beside the table
    assert tau1["tau"] == 1.0 and tau1["same_as_tau1"] == 100.0 and tau1["tokens_per_forward"] == 1.0
    assert tau0["tokens_per_forward"] > 1.0 and 0.0 <= tau0["same_as_tau1"] <= 100.0
    assert (out / "eval.png").read_bytes()[:8] == PNG
