"""vLLM decoding a MARS checkpoint plainly against the checkpoint drafting for itself (parallel drafting, K drafts a
step): tokens/s, acceptance per draft position and mean accepted length, at each batch size.

Two halves, because vLLM lives in an environment of its own: `vllm_table` runs in hf_mars's environment, writes the
prompts' token ids to a spec and runs this module in the vLLM environment (`python -m
hf_mars.tools.measure.vllm_bench SPEC OUT`), where `measure` times every method in one process, one engine each,
taking turns per repeat. Greedy, so every method returns the same tokens (checked: a mismatch is reported).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def measure(spec: dict) -> list[dict]:
    """In the vLLM environment: one row per (method, batch size), medians over the repeats."""
    from ...serving import vllm as mars_vllm

    methods = {"vLLM plain": None} | {f"vLLM, drafts itself, K = {k}": k for k in spec["draft_tokens"]}
    engines = {
        name: mars_vllm.load(
            spec["model"],
            drafter=None if k is None else "self",
            num_draft_tokens=k or 1,
            dtype=spec["dtype"],
            max_model_len=spec["max_model_len"],
        )
        for name, k in methods.items()
    }
    rows = []
    for batch in spec["batch_sizes"]:
        groups = [spec["prompts"][i : i + batch] for i in range(0, len(spec["prompts"]), batch)]
        for llm in engines.values():  # warm-up: the first batch of each engine
            mars_vllm.generate(llm, groups[0], spec["max_tokens"])
        runs = {name: [] for name in engines}
        for _ in range(spec["repeats"]):
            for name, llm in engines.items():
                runs[name].append([mars_vllm.generate(llm, group, spec["max_tokens"]) for group in groups])
        rows += [_row(name, batch, repeats, runs["vLLM plain"][0]) for name, repeats in runs.items()]
    return rows


def _row(name: str, batch: int, repeats: list[list], reference: list) -> dict:
    tokens = sum(len(ids) for run in repeats[0] for ids in run.token_ids)
    seconds = statistics.median(sum(run.seconds for run in repeat) for repeat in repeats)
    row = {"method": name, "batch": batch, "tokens_per_s": tokens / seconds, "tokens": tokens}
    row["same_tokens"] = [r.token_ids for r in repeats[0]] == [r.token_ids for r in reference]
    drafted = [run.acceptance for run in repeats[0] if run.acceptance is not None]
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
    batch_sizes=(1, 8),
    max_tokens: int = 128,
    repeats: int = 2,
    dtype: str = "float32",
) -> list[dict]:
    """Run `measure` in the vLLM environment whose interpreter is `python`; its rows, with each ratio to plain."""
    spec = {
        "model": str(model),
        "prompts": prompts,
        "draft_tokens": list(draft_tokens),
        "batch_sizes": list(batch_sizes),
        "max_tokens": max_tokens,
        "max_model_len": max(len(p) for p in prompts) + max_tokens + 8,
        "repeats": repeats,
        "dtype": dtype,
    }
    with tempfile.TemporaryDirectory() as folder:
        spec_path, out_path = Path(folder) / "spec.json", Path(folder) / "rows.json"
        spec_path.write_text(json.dumps(spec))
        # vLLM's CPU worker drops to one thread unless OMP_NUM_THREADS says otherwise: every core, as hf_mars has
        env = {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "OMP_NUM_THREADS": str(os.cpu_count()),
        }
        env |= dict(os.environ)
        command = [python, "-m", "hf_mars.tools.measure.vllm_bench", str(spec_path), str(out_path)]
        subprocess.run(command, check=True, env=env)
        rows = json.loads(out_path.read_text())
    plain = {row["batch"]: row["tokens_per_s"] for row in rows if row["method"] == "vLLM plain"}
    return [row | {"vs_plain": row["tokens_per_s"] / plain[row["batch"]]} for row in rows]


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
