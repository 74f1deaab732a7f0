"""The recipe of the shipped checkpoint: training prompts, self-distillation, the training set, scoring, τ table."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_model, make_tokenizer

from hf_mars.tools.data import (
    distill,
    gsm8k_test,
    humaneval,
    training_prompts,
    write_reference_set,
    write_training_set,
)
from hf_mars.tools.evals import (
    format_tau_table,
    gsm8k_correct,
    humaneval_correct,
    tau_table,
)


def test_training_prompts_are_mixed_and_hold_no_evaluation_problem():
    prompts = training_prompts(30, 20, 10, seed=3)
    sources = {p["source"] for p in prompts}
    assert {"gsm_symbolic", "mbpp"} <= sources and len(sources) >= 5
    assert len(prompts) >= 60 and prompts == training_prompts(30, 20, 10, seed=3)  # reproducible
    held_out = {p["prompt"].split("\nGive the result")[0][:80] for p in gsm8k_test()}
    held_out |= {p["problem"]["prompt"][:80] for p in humaneval()}
    assert not any(p["prompt"][:80] in held_out for p in prompts)
    # Each prompt carries its dataset's own answer: a worked solution, a short answer, reference code
    by_source = {p["source"]: p["reference"] for p in prompts}
    assert "####" in by_source["gsm_symbolic"] and by_source["mbpp"].startswith("```python\ndef ")
    assert all(isinstance(p["reference"], str) and p["reference"] for p in prompts)


def test_reference_set_has_the_prompts_of_the_training_set(tmp_path):
    prompts = training_prompts(6, 10, 4, seed=1)
    train = [
        {"messages": [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": f"own {i}"}]}
        for i, p in enumerate(prompts[::2])
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    assert write_reference_set(tmp_path / "train.jsonl", prompts, tmp_path / "ref.jsonl") == len(train)
    ref = [json.loads(line) for line in (tmp_path / "ref.jsonl").open()]
    assert [r["messages"][0] for r in ref] == [r["messages"][0] for r in train]
    assert [r["messages"][1]["content"] for r in ref] == [p["reference"] for p in prompts[::2]]
    with pytest.raises(ValueError, match="not among the given prompts"):
        write_reference_set(tmp_path / "train.jsonl", prompts[1::2], tmp_path / "ref.jsonl")


def test_distill_answers_with_the_model_resumes_and_keeps_finished_answers(tmp_path):
    tok = make_tokenizer()
    model = make_model("llama")
    prompts = [{"prompt": f"count {i} {i + 1}", "source": "toy"} for i in range(5)]
    out = tmp_path / "distilled.jsonl"
    distill(model, tok, prompts[:3], out, max_new_tokens=6, batch_size=2)
    distill(model, tok, prompts, out, max_new_tokens=6, batch_size=2)  # resumes: only the last two are new
    rows = [json.loads(line) for line in out.open()]
    assert sorted(r["messages"][0]["content"] for r in rows) == sorted(p["prompt"] for p in prompts)
    # The answers are the model's own greedy continuations
    row = rows[0]
    chat = tok.apply_chat_template(
        row["messages"][:1], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    greedy = model.generate(**chat, max_new_tokens=6, do_sample=False)[0, chat["input_ids"].shape[1] :]
    assert tok.decode(greedy, skip_special_tokens=True).strip() == row["messages"][1]["content"]
    assert row["finished"] == bool((greedy == tok.eos_token_id).any())

    rows[0]["finished"], rows[1]["finished"] = True, False
    rows[0]["messages"][1]["content"] = "done"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept, total = write_training_set(out, tmp_path / "train.jsonl")
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").open()]
    assert total == 5 and kept == len(train) and all(set(r) == {"messages"} for r in train)
    assert rows[0]["messages"] in [r["messages"] for r in train] and rows[1]["messages"] not in [
        r["messages"] for r in train
    ]


def test_scoring():
    assert gsm8k_correct("She has 3 + 4 = 7 apples.\nThe answer is 1,072.", "1072")
    assert not gsm8k_correct("The answer is 1,073.", "1072") and not gsm8k_correct("no number", "5")
    problem = humaneval()[2]["problem"]
    body = problem["canonical_solution"]
    assert humaneval_correct(body, problem)  # a body completes the prompt
    assert humaneval_correct(f"Sure:\n```python\n{problem['prompt']}{body}```\nDone.", problem)  # a whole function
    assert not humaneval_correct("```python\ndef truncate_number(number):\n    return 0.0\n```", problem)
    assert not humaneval_correct("```python\nwhile True:\n    pass\n```", problem, timeout=1.0)  # time limit


def test_tau_table_on_a_trained_toy(trained_toy):
    model, tok = trained_toy
    from hf_mars.tools.toy import counting_dataset

    rows = [
        {"prompt": ex["messages"][0]["content"], "task": "gsm8k", "answer": ex["messages"][1]["content"].split()[-1]}
        for ex in counting_dataset(8, seed=77)
    ]
    table = tau_table(model, tok, rows, taus=(1.0, 0.5), base_model=model, batch_size=4, max_new_tokens=40)
    base, exact, fast = table
    assert exact["same_as_tau1"] == 100.0 and exact["tokens_per_forward"] == 1.0
    assert exact["gsm8k"] == base["gsm8k"]  # τ = 1 is the model itself
    assert fast["tokens_per_forward"] > 1.3 and 0 <= fast["same_as_tau1"] <= 100
    text = format_tau_table(table)
    assert "| MARS τ=0.5 |" in text and "GSM8K" in text and "HumanEval" not in text
    assert torch.is_grad_enabled()  # decoding ran under inference_mode without leaking it
