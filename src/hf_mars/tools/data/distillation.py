"""Self-distillation: the model answers the training prompts itself, greedily, and the finished answers become its
training set (`distill`, then `write_training_set`).

Why self-distillation: MARS teaches the masks to predict the tokens the model itself would write next. Training on
the model's own greedy answers makes that target exactly the clean stream's continuation, so the clean loss has
nothing new to learn (AR behaviour is kept) and every mask learns a distribution the model can actually reach.
Reference answers written by people would pull the clean stream away from the base model and give the masks a
harder, inconsistent target. `write_reference_set` builds the same training set with the datasets' references, to
measure what self-distillation buys.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from ..checkpoints.loading import chat_text
from ..measure.decode import eos_token_ids


def distill(
    model,
    tokenizer,
    prompts: list[dict],
    out: str | Path,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    time_budget: float | None = None,
) -> dict:
    """Answer each prompt greedily with `model` and write {"messages", "source", "finished"} rows to `out` (JSONL).

    Runs on the model's device in the model's dtype (load it in bfloat16 on a GPU). Batches are left-padded and
    hold prompts of similar token length: the prompts (each once, in their shuffled order) are taken in windows of
    16 batches, each window sorted by length, so a run stopped by `time_budget` (seconds) has answered a sample of
    the whole mix, not only its shortest prompts. `out` ends in that order whatever the run's history, so every run
    of the same prompts ends with the same file. `finished` is False where the answer hit `max_new_tokens` (such rows
    are kept in the file, and left out of training by `write_training_set`).

    Resumable: prompts already in `out` or in a shard are skipped, so an interrupted run continues where it stopped.

    Under `accelerate launch` (N processes, read from accelerate's `PartialState`) each process answers every N-th
    batch of the unanswered prompts on its own device (a model the caller put on another device of the same kind
    moves there) and appends its rows to its shard, `out` with `.shard-01-of-02` before the suffix; once every
    process is done (finished or stopped by `time_budget`), the main process merges the shards into `out` and removes
    them, and the other processes wait for it. Batches never mix processes, so a fresh run's batches are those of
    one process. A killed run leaves its shards: the next run, with any number of processes, merges them first.

    Returns the stats of all processes together: {"answered", "finished", "new_tokens"} summed, "seconds" of the
    slowest, "stopped" ("time budget" if any process stopped at it, else "done"), "processes".
    """
    state = PartialState(cpu=model.device.type == "cpu")  # CPU processes join a gloo group, not N lone runs
    _place(model, state)
    out = Path(out)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    unique = list({p["prompt"]: p for p in prompts}.values())
    texts = {p["prompt"]: chat_text(tokenizer, [{"role": "user", "content": p["prompt"]}]) for p in unique}
    order = _in_length_windows(unique, texts, tokenizer, window=batch_size * 16)
    rank = {p["prompt"]: i for i, p in enumerate(order)}
    if state.is_main_process:
        _merge(out, rank)  # a killed run's shards
    state.wait_for_everyone()  # every process reads the same `out`, before any writes
    done = {_prompt(row) for row in _rows(out)}
    todo = [p for p in order if p["prompt"] not in done]
    batches = [todo[i : i + batch_size] for i in range(0, len(todo), batch_size)]
    mine = batches[state.process_index :: state.num_processes]
    target = out if state.num_processes == 1 else shard_path(out, state.process_index, state.num_processes)
    stats = _answer_all(model, tokenizer, mine, texts, target, max_new_tokens, time_budget, state)
    state.wait_for_everyone()
    if state.is_main_process:
        _merge(out, rank)
    state.wait_for_everyone()  # `out` is whole when any process returns
    return _all_processes(stats, state)


def shard_path(out: Path, index: int, processes: int) -> Path:
    """Where process `index` of `processes` writes its answers: distilled.jsonl -> distilled.shard-01-of-02.jsonl."""
    return out.with_name(f"{out.stem}.shard-{index + 1:02d}-of-{processes:02d}{out.suffix}")


def _place(model, state: PartialState) -> None:
    """With several processes, answer on this process's device: each process's `.to("cuda")` lands on GPU 0."""
    if state.num_processes == 1 or getattr(model, "hf_device_map", None) is not None:
        return  # one process, or a model the caller spread over devices itself
    if model.device.type == state.device.type and model.device != state.device:
        model.to(state.device)


def _answer_all(model, tokenizer, batches, texts, target: Path, max_new_tokens, time_budget, state) -> dict:
    """Answer `batches` in order, appending each batch's rows to `target` as it ends; this process's stats."""
    eos_ids = torch.tensor(eos_token_ids(model, tokenizer))  # generate() stops at any: an answer that did is finished
    stats = {"answered": 0, "finished": 0, "new_tokens": 0, "seconds": 0.0, "stopped": "done"}
    desc = "self-distillation"
    if state.num_processes > 1:
        desc += f" (process 1 of {state.num_processes}, its share)"  # the other processes show no bar
    total = sum(len(chunk) for chunk in batches)
    start = time.monotonic()
    bar = tqdm(total=total, desc=desc, unit="prompt", disable=not state.is_main_process)
    with target.open("a") as f, bar:
        for chunk in batches:
            if time_budget is not None and time.monotonic() - start >= time_budget:
                stats["stopped"] = "time budget"
                break
            answers = _answer_batch(model, tokenizer, [texts[p["prompt"]] for p in chunk], max_new_tokens)
            for p, tokens in zip(chunk, answers):
                row, length = _answered_row(tokenizer, p, tokens, eos_ids)
                f.write(json.dumps(row) + "\n")
                stats["finished"] += row["finished"]
                stats["new_tokens"] += length
            f.flush()
            stats["answered"] += len(chunk)
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{stats['new_tokens'] / max(time.monotonic() - start, 1e-9):.0f}")
    stats["seconds"] = round(time.monotonic() - start, 1)
    return stats


def _all_processes(stats: dict, state: PartialState) -> dict:
    """Every process's stats, combined: what the whole run did (one process: its own stats)."""
    every = gather_object([stats])
    return {
        "answered": sum(s["answered"] for s in every),
        "finished": sum(s["finished"] for s in every),
        "new_tokens": sum(s["new_tokens"] for s in every),
        "seconds": max(s["seconds"] for s in every),
        "stopped": "time budget" if any(s["stopped"] == "time budget" for s in every) else "done",
        "processes": state.num_processes,
    }


def _prompt(row: dict) -> str:
    return row["messages"][0]["content"]


def _rows(path: Path) -> list[dict]:
    """The rows of a `distill` file; a last line without its newline (the process was killed writing it) is left
    out, and its prompt answered again."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]]


def _merge(out: Path, rank: dict[str, int]) -> None:
    """Rewrite `out` with its rows and its shards' rows, each prompt once, in `rank` order (rows of prompts not in
    `rank` first, as they were), then remove the shards. Untouched when nothing would change."""
    shards = sorted(out.parent.glob(f"{out.stem}.shard-*-of-*{out.suffix}"))
    rows = {}
    for row in [*_rows(out), *(row for shard in shards for row in _rows(shard))]:
        rows.setdefault(_prompt(row), row)  # an answer merged once already and still in a shard: the first
    ordered = sorted(rows.values(), key=lambda row: rank.get(_prompt(row), -1))
    text = "".join(json.dumps(row) + "\n" for row in ordered)
    if shards or not out.exists() or out.read_text() != text:
        partial = out.with_name(out.name + ".merging")
        partial.write_text(text)
        partial.replace(out)  # atomic: a run killed here leaves `out` whole, old or new
    for shard in shards:
        shard.unlink()


def _in_length_windows(todo: list[dict], texts: dict[str, str], tokenizer, window: int) -> list[dict]:
    """`todo` in windows of `window` prompts, each window sorted by the token length of its chat text: a batch holds
    prompts of similar length (little padding), and a run stopped early has answered a sample of the whole mix."""
    ids = tokenizer(list(texts.values()), add_special_tokens=False).input_ids
    lengths = {prompt: len(tokens) for prompt, tokens in zip(texts, ids)}
    return [
        p
        for i in range(0, len(todo), window)
        for p in sorted(todo[i : i + window], key=lambda p: lengths[p["prompt"]])
    ]


def _answer_batch(model, tokenizer, texts: list[str], max_new_tokens: int) -> torch.Tensor:
    """The model's greedy answers to chat texts, generated as one left-padded batch: their new tokens, on the CPU."""
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.inference_mode():
        seqs = model.generate(**enc.to(model.device), max_new_tokens=max_new_tokens, do_sample=False)
    return seqs[:, enc.input_ids.shape[1] :].cpu()


def _answered_row(tokenizer, prompt: dict, tokens: torch.Tensor, eos_ids: torch.Tensor) -> tuple[dict, int]:
    """A `distill` row for one answer, and the answer's length in tokens: up to its first EOS when it finished."""
    eos = torch.isin(tokens, eos_ids).nonzero()
    finished = len(eos) > 0
    answer = tokenizer.decode(tokens, skip_special_tokens=True).strip()
    messages = [{"role": "user", "content": prompt["prompt"]}, {"role": "assistant", "content": answer}]
    length = int(eos[0, 0]) + 1 if finished else len(tokens)
    return {"messages": messages, "source": prompt["source"], "finished": finished}, length


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
