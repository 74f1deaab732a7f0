"""vLLM decoding a MARS checkpoint plainly against the checkpoint drafting for itself (parallel drafting, K drafts a
step from a second forward) and against MARS's own step (K drafts from the masks of the verifying forward itself,
`serving/vllm_step.py`): tokens/s, acceptance per draft position and mean accepted length, at each batch size.

Two halves, because vLLM lives in an environment of its own: `vllm_table` runs in hf_mars's environment and runs
this module in the vLLM environment once per method (`python -m hf_mars.tools.measure.vllm_bench SPEC OUT`), where
`measure` times that method at every batch size. One engine per process: vLLM keeps its counters per process, and a
second engine in the same process reads the first one's. Greedy, so every method returns the same tokens (checked:
a mismatch is reported).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ...serving.vllm import MARS_STEP, SMALL_CPU

METHODS = {None: "vLLM plain", "self": "vLLM, drafts itself, K = {k}", MARS_STEP: "vLLM, MARS step, K = {k}"}


def measure(spec: dict) -> list[dict]:
    """In the vLLM environment: one row per batch size for the method `spec["drafter"]` names (None: plain; "self";
    "mars-step") with `spec["draft_tokens"]` drafts a step, the median time over the repeats after a warm-up batch."""
    from ...serving import vllm as mars_vllm

    k, drafter = spec["draft_tokens"], spec["drafter"]
    llm = mars_vllm.load(
        spec["model"],
        drafter=drafter,
        num_draft_tokens=k or 1,
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
    )
    rows = []
    for batch in spec["batch_sizes"]:
        groups = [spec["prompts"][i : i + batch] for i in range(0, len(spec["prompts"]), batch)]
        mars_vllm.generate(llm, groups[0], spec["max_tokens"])  # warm-up
        repeats = [[mars_vllm.generate(llm, g, spec["max_tokens"]) for g in groups] for _ in range(spec["repeats"])]
        rows.append(_row(METHODS[drafter].format(k=k), batch, repeats))
    return rows


def _row(name: str, batch: int, repeats: list[list]) -> dict:
    token_ids = [ids for run in repeats[0] for ids in run.token_ids]
    seconds = statistics.median(sum(run.seconds for run in repeat) for repeat in repeats)
    row = {"method": name, "batch": batch, "tokens_per_s": sum(map(len, token_ids)) / seconds, "token_ids": token_ids}
    drafted = [run.acceptance for repeat in repeats for run in repeat if run.acceptance is not None]
    if drafted:
        steps = sum(a.steps for a in drafted)
        per_position = [sum(column) for column in zip(*(a.per_position for a in drafted))]
        row["acceptance_per_position"] = [count / steps for count in per_position]
        row["mean_accepted_length"] = 1 + sum(per_position) / steps
    return row


def vllm_table(
    model: str | Path,
    prompts: list[list[int]],
    python: str,
    *,
    draft_tokens=(2, 3, 4),
    step_tokens=(1, 2, 3),
    batch_sizes=(1, 8),
    max_tokens: int = 128,
    repeats: int = 2,
    dtype: str = "float32",
) -> list[dict]:
    """Each method's rows from the vLLM environment whose interpreter is `python`, with its ratio to plain and
    whether its tokens are plain's: plain, parallel drafting with each of `draft_tokens`, MARS's step with each of
    `step_tokens` (at most the checkpoint's B-1)."""
    spec = {
        "model": str(model),
        "prompts": prompts,
        "batch_sizes": list(batch_sizes),
        "max_tokens": max_tokens,
        "max_model_len": max(len(p) for p in prompts) + max_tokens + 8,
        "repeats": repeats,
        "dtype": dtype,
    }
    methods = [(None, None), *(("self", k) for k in draft_tokens), *((MARS_STEP, k) for k in step_tokens)]
    rows = [row for d, k in methods for row in _in_vllm(python, spec | {"drafter": d, "draft_tokens": k})]
    plain = {row["batch"]: (row["tokens_per_s"], row["token_ids"]) for row in rows if row["method"] == "vLLM plain"}
    for row in rows:
        speed, tokens = plain[row["batch"]]
        row["vs_plain"], row["same_tokens"] = row["tokens_per_s"] / speed, row.pop("token_ids") == tokens
    return rows


def _in_vllm(python: str, spec: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        spec_path, out_path = Path(folder) / "spec.json", Path(folder) / "rows.json"
        spec_path.write_text(json.dumps(spec))
        # vLLM's CPU worker drops to one thread unless OMP_NUM_THREADS says otherwise: every core, as hf_mars has
        env = SMALL_CPU | {"OMP_NUM_THREADS": str(os.cpu_count())} | dict(os.environ)
        command = [python, "-m", "hf_mars.tools.measure.vllm_bench", str(spec_path), str(out_path)]
        subprocess.run(command, check=True, env=env)
        return json.loads(out_path.read_text())


def format_rows(rows: list[dict]) -> str:
    lines = [
        "| batch | method | tokens/s | vs vLLM plain | tokens per target forward | acceptance per position |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        rates = " / ".join(f"{rate:.2f}" for rate in row.get("acceptance_per_position", [])) or "-"
        length = f"{row['mean_accepted_length']:.2f}" if "mean_accepted_length" in row else "1.00"
        same = "" if row["same_tokens"] else " (other tokens!)"
        lines.append(
            f"| {row['batch']} | {row['method']}{same} | {row['tokens_per_s']:.1f} | {row['vs_plain']:.2f}x "
            f"| {length} | {rates} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    spec_file, out_file = sys.argv[1:3]
    Path(out_file).write_text(json.dumps(measure(json.loads(Path(spec_file).read_text()))))
