"""Runs greedy jobs on vLLM's CPU build for tests/serving/test_vllm.py, in the vLLM venv (HF_MARS_VLLM_PYTHON), where
hf_mars is installed without its dependencies: `python vllm_worker.py JOBS.json OUT.json`.

JOBS.json: {"prompts": [[ids...], ...], "max_tokens": N, "jobs": [{"model": PATH,
"drafter": PATH|"self"|"mars-step"|null, "num_draft_tokens": K}, ...]}. OUT.json: per job, each prompt's tokens and
vLLM's acceptance counters. The jobs share one process (vLLM's start costs more than a tiny model's run); each
engine is dropped before the next is made.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys

from hf_mars.serving import vllm as mars_vllm  # imports no vLLM: the environment is set before it does

os.environ.update(mars_vllm.SMALL_CPU | dict(os.environ))


def main(jobs_path: str, out_path: str) -> None:
    spec = json.loads(open(jobs_path).read())
    results = []
    for job in spec["jobs"]:
        try:
            llm = mars_vllm.load(
                job["model"],
                drafter=job.get("drafter"),
                num_draft_tokens=job.get("num_draft_tokens", 3),
                dtype="float32",
                max_model_len=512,
                enforce_eager=True,
            )
        except mars_vllm.NotADrafter as error:
            results.append({"refused": str(error)})
            continue
        run = mars_vllm.generate(llm, spec["prompts"], spec["max_tokens"])
        results.append(
            {
                "token_ids": run.token_ids,
                "acceptance": dataclasses.asdict(run.acceptance) if run.acceptance else None,
            }
        )
        del llm
        gc.collect()
    with open(out_path, "w") as out:
        json.dump(results, out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
