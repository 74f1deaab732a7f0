"""One process of a self-distillation run, for tests/tools/test_distill_processes.py: the test calls `run` in its own
process for one-process runs, and launches two as users launch them, `accelerate launch --config_file
examples/accelerate/multi_cpu.yaml distill_worker.py ...`. Each launched process writes the stats `distill` returned
to STATS-<process index>.json.

`--stop-after K` stops each process after exactly K batches through `distill`'s own time budget (its clock reads
the batches begun, and the budget is K of them), so where a run stops does not depend on the machine's speed.
`--die-after K` kills each process where it would begin batch K+1, as a crash or a kill would.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

from accelerate import PartialState
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_mars.tools.data import distillation


@contextlib.contextmanager
def batches_as_seconds(model, die_after: int | None = None):
    """While open, `distill`'s clock reads how many batches `model` has begun, one second each."""
    begun = 0
    generate = model.generate

    def counted(*args, **kwargs):
        nonlocal begun
        if begun == die_after:
            os._exit(3)  # no clean-up, no merge: what a killed process leaves
        begun += 1
        return generate(*args, **kwargs)

    model.generate = counted
    saved = distillation.time
    distillation.time = SimpleNamespace(monotonic=lambda: float(begun))
    try:
        yield
    finally:
        distillation.time = saved
        del model.generate


def run(base, prompts, out, batch_size: int, stop_after: int | None = None, die_after: int | None = None) -> dict:
    """`distill` of the prompts (a JSONL file) by the saved model `base`, on the CPU in float32: its stats."""
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    tokenizer = AutoTokenizer.from_pretrained(base)
    rows = [json.loads(line) for line in open(prompts)]
    with batches_as_seconds(model, die_after):
        return distillation.distill(
            model, tokenizer, rows, out, max_new_tokens=6, batch_size=batch_size, time_budget=stop_after
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("base", help="a saved model and tokenizer")
    parser.add_argument("prompts", help='a JSONL file of {"prompt", "source"} rows')
    parser.add_argument("out", help="the distill file")
    parser.add_argument("stats", help="where each process writes its stats: STATS-0.json, STATS-1.json, ...")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--stop-after", type=int, help="batches per process before the time budget stops it")
    parser.add_argument("--die-after", type=int, help="batches per process before it is killed")
    args = parser.parse_args()
    stats = run(args.base, args.prompts, args.out, args.batch_size, args.stop_after, args.die_after)
    Path(f"{args.stats}-{PartialState().process_index}.json").write_text(json.dumps(stats))


if __name__ == "__main__":
    main()
