"""Self-distillation in several processes (`distill` under `accelerate launch`): two CPU processes, launched as users
launch them (`accelerate launch --config_file examples/accelerate/multi_cpu.yaml ...`, as
tests/training/test_multiprocess.py does), write the file one process writes; a run stopped by its time budget or
killed part-way is finished by a run with the other process count, with every prompt answered once, into that same
file.

Why the files can be compared byte for byte, with no tolerance: greedy answers are float32 CPU computations, and a
prompt's logits depend on the batch it is in (left padding changes the matmul shapes, so the reduction order, so the
last bits, and a near tie can flip a greedy token). The runs compared here give each prompt the same batch:
- a fresh run cuts the same length-windowed order into the same batches whatever the process count, and deals them
  out whole (batch j to process j mod N), so at any batch size the two runs run the same batches;
- runs that resume after a stop answer the prompts left, which regroups them: those use batch size 1, where a
  prompt's batch is itself.
Every process runs one thread (OMP_NUM_THREADS=1 in the launched ones, torch.set_num_threads(1) in this one), so the
same batch gives the same bits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from accelerate import PartialState
from distill_worker import run
from helpers import make_model, make_tokenizer, run_launched

from hf_mars.tools.data.distillation import shard_path

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("distill_worker.py")
CONFIG = ROOT / "examples" / "accelerate" / "multi_cpu.yaml"
TIMEOUT = 600  # a hang guard: a launch takes 10-30 s on 2 cores (start, import torch, 36 short answers), far more when
# other work holds the cores
# 36 prompts of lengths that rise and fall (windowing sorts something), and one of them twice (answered once)
PROMPTS = [{"prompt": f"{i}: " + "ab " * (i * 7 % 11), "source": "toy"} for i in range(36)]
PROMPTS.append(dict(PROMPTS[5]))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny random Llama saved as a base model, and the prompts as a JSONL file: (base, prompts)."""
    folder = tmp_path_factory.mktemp("distill-processes")
    make_model("llama").save_pretrained(folder / "base")
    make_tokenizer().save_pretrained(folder / "base")
    (folder / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return folder / "base", folder / "prompts.jsonl"


@pytest.fixture(autouse=True)
def one_process_state():
    """Runs in this process on one thread, as the launched processes; and no PartialState (which `distill` sets up)
    left to later tests."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    PartialState._reset_state()


def launch(base, out, batch_size, stop_after=None, die_after=None):
    """Two processes of tests/tools/distill_worker.py under `accelerate launch`: (return code, the run's stats)."""
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG), str(WORKER)]
    prefix = out.with_name("stats")
    for old in out.parent.glob("stats-*.json"):
        old.unlink()
    args = [*(str(p) for p in base), str(out), str(prefix), "--batch-size", str(batch_size)]
    args += ["--stop-after", str(stop_after)] if stop_after is not None else []
    args += ["--die-after", str(die_after)] if die_after is not None else []
    returncode, stderr = run_launched([*launcher, *args], TIMEOUT)
    stats = [json.loads(path.read_text()) for path in sorted(out.parent.glob("stats-*.json"))]
    if die_after is None:
        assert returncode == 0, stderr[-3000:]
        assert len(stats) == 2 and stats[0] == stats[1]  # every process returns the run's stats, all processes'
    return returncode, stats[0] if stats else None


def prompts_of(path):
    return [json.loads(line)["messages"][0]["content"] for line in path.open()]


def shards(out):
    return sorted(out.parent.glob(f"{out.stem}.shard-*{out.suffix}"))


@pytest.mark.slow  # a two-process launch: about 15 s on 2 cores
def test_two_processes_write_the_file_one_process_writes(base, tmp_path):
    one, two = tmp_path / "one" / "distilled.jsonl", tmp_path / "two" / "distilled.jsonl"
    one.parent.mkdir(), two.parent.mkdir()
    # Batch size 4: 9 batches, 5 and 4 per process, the 9 batches of one process (see the module docstring)
    stats_one = run(*base, one, batch_size=4)
    _, stats_two = launch(base, two, batch_size=4)
    assert one.read_bytes() == two.read_bytes()
    assert sorted(prompts_of(two)) == sorted({p["prompt"] for p in PROMPTS}) and not shards(two)
    # Sorted within windows of 64 prompts (here all 36): the rows run from the shortest prompt to the longest
    lengths = [len(prompt) for prompt in prompts_of(two)]
    assert lengths == sorted(lengths) and len(set(lengths)) > 1
    assert stats_one["processes"] == 1 and stats_two["processes"] == 2
    for key in ("answered", "finished", "new_tokens"):  # the sums of both processes' counts: one process's
        assert stats_two[key] == stats_one[key], key
    assert stats_two["answered"] == 36 and stats_two["stopped"] == "done"
    assert 36 <= stats_two["new_tokens"] <= 36 * 6  # each answer: 1 to max_new_tokens (6) tokens


@pytest.mark.slow  # two two-process launches: about 40 s on 2 cores
def test_a_stopped_or_killed_run_is_finished_by_the_other_process_count(base, tmp_path):
    reference = tmp_path / "reference" / "distilled.jsonl"
    reference.parent.mkdir()
    out = tmp_path / "distilled.jsonl"
    run(*base, reference, batch_size=1)  # one process, uninterrupted

    # Two processes killed as each would begin its 4th batch: their shards keep what they wrote, nothing is merged
    code, _ = launch(base, out, batch_size=1, die_after=3)
    assert code != 0 and out.read_text() == ""
    assert [s.name for s in shards(out)] == ["distilled.shard-01-of-02.jsonl", "distilled.shard-02-of-02.jsonl"]
    assert shards(out)[0] == shard_path(out, 0, 2)
    killed = [prompt for shard in shards(out) for prompt in prompts_of(shard)]
    assert 3 <= len(killed) <= 6  # the first process to die had written 3 rows; the launcher ends the other
    with shards(out)[1].open("a") as f:
        f.write('{"messages": [{"role": "user", "content": "4: ab')  # a row cut short: a kill while writing it

    # One process, stopped by its time budget after 5 batches: the shards merged into `out`, with its 5 new rows
    stats = run(*base, out, batch_size=1, stop_after=5)
    assert stats["stopped"] == "time budget" and stats["answered"] == 5 and not shards(out)
    assert len(prompts_of(out)) == len(set(prompts_of(out))) == len(killed) + 5
    assert set(killed) < set(prompts_of(out))

    # Two processes, each stopped after 4 batches: 8 more rows, merged although the run stopped
    before = len(prompts_of(out))
    _, stats = launch(base, out, batch_size=1, stop_after=4)
    assert stats["stopped"] == "time budget" and stats["answered"] == 8 and not shards(out)
    assert len(prompts_of(out)) == len(set(prompts_of(out))) == before + 8

    # One process finishes: the rest, each once, and the file is the uninterrupted run's, byte for byte
    stats = run(*base, out, batch_size=1)
    assert stats["stopped"] == "done" and stats["answered"] == 36 - before - 8
    assert out.read_bytes() == reference.read_bytes() and not shards(out)
    assert run(*base, out, batch_size=1)["answered"] == 0  # a finished file: nothing left to answer
