"""EleutherAI lm-evaluation-harness (`lm_eval`, HF backend) on a MARS checkpoint, unchanged: the checkpoint loads by
path with `trust_remote_code=True` and MARS settings ride in `gen_kwargs`.

The task is a local `generate_until` task (a YAML and a jsonl in a temporary folder). Its stop sequence is a
multi-token string taken from the greedy output itself, so lm-eval's `MultiTokenEOSCriteria` really stops
generation mid-answer. At batch size 4 lm-eval pads prompts and keeps one `done` flag per row.

τ = 1 and lossless mode (`mars_verify=True`) must give exactly the answers of the same run without MARS kwargs;
τ = 0.9 must reach the decoder (answers differ from greedy; at batch size 1 they are `model.generate(mars_tau=0.9)`'s).
"""

from __future__ import annotations

import json
import os
import string
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import lm_eval
import pytest
import torch
from lm_eval.tasks import TaskManager
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_mars.tools.checkpoints.toy import counting_dataset

TASK = "mars_toy"
DOCS = 6  # batch size 4 then runs a full batch of 4 and a batch of 2
MAX_GEN = 20
PRINTABLE = set(string.ascii_letters + string.digits + string.punctuation)


@dataclass
class ToyTask:
    folder: Path
    stop: str
    prompts: list[str]  # as lm-eval builds them (doc_to_text)
    greedy: list[str]  # model.generate's greedy answers, cut at the stop sequence as lm-eval cuts them
    stopped: int  # a document whose greedy answer the stop sequence cuts short
    tasks: TaskManager  # this task only (indexing lm-eval's own thousands of tasks takes ~20 s)


def cut(text: str, stop: str) -> str:
    return text.split(stop)[0]


def generate(model, tok, prompt: str, **kwargs) -> str:
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=MAX_GEN, do_sample=False, **kwargs)
    return tok.decode(out[0, enc.input_ids.shape[1] :], skip_special_tokens=True)


def pick_stop(texts: list[str]) -> tuple[str, int]:
    """Two printable ASCII characters (two tokens to the byte-level toy tokenizer) that greedy decoding writes mid-way
    through an answer, and the index of that answer."""
    for doc, text in enumerate(texts):
        for i in range(4, len(text) - 4):
            stop = text[i : i + 2]
            if set(stop) <= PRINTABLE and stop not in text[: i + 1]:
                return stop, doc
    raise AssertionError(f"no printable two-character stop sequence in the greedy answers {texts!r}")


@pytest.fixture(scope="module")
def toy_task(client_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval_task")
    docs = [
        {"question": ex["messages"][0]["content"], "answer": ex["messages"][1]["content"]}
        for ex in counting_dataset(DOCS, seed=7)
    ]
    (folder / "data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    prompts = [d["question"] + "\n" for d in docs]
    model = AutoModelForCausalLM.from_pretrained(client_checkpoint, trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(client_checkpoint)
    full = [generate(model, tok, p) for p in prompts]
    stop, stopped = pick_stop(full)
    assert len(tok.encode(stop, add_special_tokens=False)) >= 2
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(folder / 'data.jsonl'))}\n"
        "test_split: test\n"
        "output_type: generate_until\n"
        'doc_to_text: "{{question}}\\n"\n'
        'doc_to_target: "{{answer}}"\n'
        f"generation_kwargs:\n  until: [{json.dumps(stop)}]\n  max_gen_toks: {MAX_GEN}\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    tasks = TaskManager(include_path=str(folder), include_defaults=False)
    return ToyTask(folder, stop, prompts, [cut(t, stop) for t in full], stopped, tasks)


def evaluate(checkpoint, task: ToyTask, batch_size: int, gen_kwargs: str | None = None) -> list[str]:
    """lm-eval's answers (`filtered_resps`) in document order, after checking `resps` agree with them."""
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={checkpoint},trust_remote_code=True,dtype=float32",
        tasks=[TASK],
        task_manager=task.tasks,
        batch_size=batch_size,
        device="cpu",
        gen_kwargs=gen_kwargs,
        log_samples=True,
    )
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    assert len(samples) == DOCS
    answers = [s["filtered_resps"][0] for s in samples]
    assert [s["resps"][0][0] for s in samples] == answers
    assert results["results"][TASK]["sample_len"] == DOCS
    return answers


_greedy: dict[int, list[str]] = {}


def greedy_answers(checkpoint, task, batch_size):
    """The same lm-eval run with no MARS kwargs (computed once per batch size)."""
    if batch_size not in _greedy:
        _greedy[batch_size] = evaluate(checkpoint, task, batch_size)
    return _greedy[batch_size]


@pytest.mark.parametrize("batch_size", [1, 4])
def test_plain_run_is_greedy_and_stops(client_checkpoint, toy_task, batch_size):
    """The harness set-up itself: without MARS kwargs lm-eval answers greedily and its stop sequence fires."""
    answers = greedy_answers(client_checkpoint, toy_task, batch_size)
    assert answers == toy_task.greedy
    assert len(answers[toy_task.stopped]) < MAX_GEN - 2


@pytest.mark.parametrize("gen_kwargs", ["mars_tau=1.0", "mars_verify=True"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_mars_exact_modes_give_greedy_answers(client_checkpoint, toy_task, batch_size, gen_kwargs):
    answers = evaluate(client_checkpoint, toy_task, batch_size, gen_kwargs)
    assert answers == greedy_answers(client_checkpoint, toy_task, batch_size)


@pytest.mark.parametrize("batch_size", [1, 4])
def test_mars_tau_09(client_checkpoint, toy_task, batch_size):
    answers = evaluate(client_checkpoint, toy_task, batch_size, "mars_tau=0.9")
    assert answers != greedy_answers(client_checkpoint, toy_task, batch_size)  # the kwarg reached the decoder
    assert all(toy_task.stop not in a for a in answers)
    if batch_size == 1:
        model = AutoModelForCausalLM.from_pretrained(client_checkpoint, trust_remote_code=True)
        tok = AutoTokenizer.from_pretrained(client_checkpoint)
        assert answers == [cut(generate(model, tok, p, mars_tau=0.9), toy_task.stop) for p in toy_task.prompts]


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, 4])
def test_cli(client_checkpoint, toy_task, tmp_path, batch_size):
    """The documented command line (docs/clients.md), lossless mode: the saved answers are greedy's."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "run",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={client_checkpoint},trust_remote_code=True,dtype=float32",
        "--tasks",
        TASK,
        "--include_path",
        str(toy_task.folder),
        "--device",
        "cpu",
        "--batch_size",
        str(batch_size),
        "--gen_kwargs",
        "mars_verify=True",
        "--log_samples",
        "--output_path",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"|{TASK}|" in proc.stdout.replace(" ", "")
    (samples_file,) = tmp_path.glob(f"*/samples_{TASK}_*.jsonl")
    samples = sorted((json.loads(line) for line in samples_file.read_text().splitlines()), key=lambda s: s["doc_id"])
    assert [s["filtered_resps"][0] for s in samples] == greedy_answers(client_checkpoint, toy_task, batch_size)
