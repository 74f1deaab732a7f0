"""lm-eval's `local-completions` client, the one teams point at OpenAI-compatible servers, against `hf-mars serve`.

A loglikelihood task (`multiple_choice`: lm-eval sends `echo=true, logprobs=1, max_tokens=1` for each choice) and a
generation task (`generate_until`, with a stop sequence and MARS settings riding in `gen_kwargs`), each on a few
documents, must give what lm-eval's HF backend gives on the same checkpoint: the same log likelihoods (float32, one
forward each side, to rounding) and the same greedy judgements, and greedy generation's answers.
"""

from __future__ import annotations

import json

import lm_eval
import pytest
from helpers import serving
from lm_eval.tasks import TaskManager

from hf_mars.tools.checkpoints.toy import counting_dataset

DOCS = 4


@pytest.fixture(scope="module")
def served(client_checkpoint):
    from hf_mars.serving.server import build_app

    app, _ = build_app(str(client_checkpoint), dtype="float32", device="cpu", max_batch_size=4)
    with serving(app) as url:
        yield url


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """Two local tasks on counting questions: choose the right answer of three; write the answer until "9"."""
    folder = tmp_path_factory.mktemp("served_tasks")
    docs = []
    for example in counting_dataset(DOCS, seed=11):
        question, answer = example["messages"][0]["content"], example["messages"][1]["content"]
        docs.append({"question": question, "answer": answer, "choices": [answer, answer[::-1], answer.upper() + "!"]})
    data = json.dumps(str(folder / "data.jsonl"))
    (folder / "data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    common += 'doc_to_text: "{{question}}\\n"\n'
    (folder / "served_choice.yaml").write_text(
        "task: served_choice\n" + common + "output_type: multiple_choice\n"
        'doc_to_choice: "{{choices}}"\ndoc_to_target: 0\nmetric_list:\n  - metric: acc\n'
    )
    (folder / "served_until.yaml").write_text(
        "task: served_until\n" + common + 'output_type: generate_until\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["9"]\n  max_gen_toks: 16\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    return TaskManager(include_path=str(folder), include_defaults=False)


def run(model: str, model_args: str, task: str, tasks: TaskManager, gen_kwargs: str | None = None) -> list:
    """Each document's `resps` in document order."""
    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=tasks,
        batch_size=1,
        device="cpu",
        gen_kwargs=gen_kwargs,
        log_samples=True,
    )
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    assert len(samples) == DOCS
    return [s["resps"] for s in samples]


def served_args(url: str, checkpoint) -> str:
    return (
        f"base_url={url}/v1/completions,model={checkpoint},tokenizer={checkpoint},tokenizer_backend=huggingface,"
        "max_retries=1"
    )


def test_loglikelihoods_through_the_server_are_the_hf_backends(served, client_checkpoint, tasks):
    local = run("local-completions", served_args(served, client_checkpoint), "served_choice", tasks)
    hf = run("hf", f"pretrained={client_checkpoint},trust_remote_code=True,dtype=float32", "served_choice", tasks)
    flat = [(choice[0], hf_choice[0]) for doc, hf_doc in zip(local, hf) for choice, hf_choice in zip(doc, hf_doc)]
    assert len(flat) == 3 * DOCS
    for (ll, greedy), (hf_ll, hf_greedy) in flat:
        assert float(ll) == pytest.approx(float(hf_ll), abs=1e-4) and bool(greedy) == bool(hf_greedy)
    assert len({round(float(ll), 3) for (ll, _), _ in flat}) > DOCS  # the choices were really scored apart


@pytest.mark.parametrize("gen_kwargs", [None, "mars_verify=True"])
def test_generation_through_the_server_is_the_hf_backends_greedy(served, client_checkpoint, tasks, gen_kwargs):
    """MARS settings reach the server as top-level fields of lm-eval's payload; lossless mode keeps greedy's text."""
    local = run("local-completions", served_args(served, client_checkpoint), "served_until", tasks, gen_kwargs)
    hf = run("hf", f"pretrained={client_checkpoint},trust_remote_code=True,dtype=float32", "served_until", tasks)
    assert local == hf and all(doc[0] for doc in local)
