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
from tqdm.auto import tqdm

from .decode import eos_token_ids
from .loading import chat_text


def distill(
    model,
    tokenizer,
    prompts: list[dict],
    out: str | Path,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    time_budget: float | None = None,
) -> dict:
    """Answer each prompt greedily with `model` and append {"messages", "source", "finished"} rows to `out` (JSONL).

    Runs on the model's device in the model's dtype (load it in bfloat16 on a GPU). Resumable: prompts already in
    `out` are skipped, so an interrupted run continues where it stopped. Batches are left-padded and hold prompts of
    similar token length: the prompts are taken in their (shuffled) order in windows of 16 batches, each window
    sorted by length, so a run stopped by `time_budget` (seconds) has answered a sample of the whole mix, not only
    its shortest prompts. `finished` is False where the answer hit `max_new_tokens` (such rows are kept in the file,
    and left out of training by `write_training_set`). Returns {"answered", "finished", "new_tokens", "seconds",
    "stopped"} for this call; "stopped" is "time budget" or "done".
    """
    out = Path(out)
    todo = _unanswered(prompts, out)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    texts = {p["prompt"]: chat_text(tokenizer, [{"role": "user", "content": p["prompt"]}]) for p in todo}
    todo = _in_length_windows(todo, texts, tokenizer, window=batch_size * 16)
    eos_ids = torch.tensor(eos_token_ids(model, tokenizer))  # generate() stops at any: an answer that did is finished
    stats = {"answered": 0, "finished": 0, "new_tokens": 0, "seconds": 0.0, "stopped": "done"}
    start = time.monotonic()
    with out.open("a") as f, tqdm(total=len(todo), desc="self-distillation", unit="prompt") as bar:
        for i in range(0, len(todo), batch_size):
            if time_budget is not None and time.monotonic() - start >= time_budget:
                stats["stopped"] = "time budget"
                break
            chunk = todo[i : i + batch_size]
            answers = _answer_batch(model, tokenizer, [texts[p["prompt"]] for p in chunk], max_new_tokens)
            for p, tokens in zip(chunk, answers):
                row, length = _answered_row(tokenizer, p, tokens, eos_ids)
                f.write(json.dumps(row) + "\n")
                stats["finished"] += row["finished"]
                stats["new_tokens"] += length
            f.flush()
            stats["answered"] += len(chunk)
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{stats['new_tokens'] / (time.monotonic() - start):.0f}")
    stats["seconds"] = round(time.monotonic() - start, 1)
    return stats


def _unanswered(prompts: list[dict], out: Path) -> list[dict]:
    """The prompts not yet answered in `out`, each once: what a resumed run has left to do."""
    done = set()
    if out.exists():
        done = {json.loads(line)["messages"][0]["content"] for line in out.open()}
    return list({p["prompt"]: p for p in prompts if p["prompt"] not in done}.values())


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
