"""`n` choices of one request (OpenAI's `n`): n requests of one choice each, sent to the engine at once, so that they
decode as rows of one batch (they share every setting, so they join one another), their answers merged into one.

Whole answers merge their `choices` (each its `index`) and add up their `usage`; streams interleave their chunks as
they come, each choice's delta under its own `index`, and end with one chunk of the summed `usage`, as OpenAI's last
chunk has it (`choices` empty). With a `seed`, the choices decode as a batch of their own, opened once all have
arrived, right after the seed is set: the same request draws the same choices again.

`best_of` (completions, not streamed) decodes that many choices with their tokens' log probabilities and answers the
n of the highest log probability per token (`likeliest`); `usage` counts every choice decoded, as OpenAI bills them.
"""

from __future__ import annotations

import asyncio
import json
import math

MAX_CHOICES = 128  # OpenAI's limit
# The body field by which a seeded request's choices tell the engine they are one group (`{"group", "n", "seed"}`):
# it opens them together, as a batch of their own, after seeding torch's generator, so that the seed draws the same
# choices again. Set by the server on the requests it makes, never read from a client's body.
CHOICES_KEY = "_hf_mars_choices"


def check_choices(n) -> int:
    """`n` as an int, or a `ValueError` naming why it is not one of 1 to `MAX_CHOICES`."""
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise ValueError(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}")
    return n


def check_best_of(best_of, n: int, stream: bool) -> int:
    """`best_of` (completions) as an int: how many choices to decode, of which the `n` likeliest are answered; a
    `ValueError` naming why it cannot be (below n, beyond `MAX_CHOICES`, streamed)."""
    if best_of is None or best_of == n:
        return n
    if isinstance(best_of, bool) or not isinstance(best_of, int) or not n <= best_of <= MAX_CHOICES:
        raise ValueError(f"best_of must be an integer in [n, {MAX_CHOICES}] (n = {n}), got {best_of!r}")
    if stream:
        raise ValueError("best_of cannot be streamed: the likeliest choices are known once all have ended")
    return best_of


def likeliest(answers: list[dict], n: int) -> list[dict]:
    """The `n` answers of the highest log probability per token (OpenAI's `best_of`), in that order; each answer's
    choice carries its tokens' log probabilities (`logprobs.token_logprobs`)."""

    def per_token(answer: dict) -> float:
        scored = answer["choices"][0]["logprobs"]["token_logprobs"]
        return sum(scored) / len(scored) if scored else -math.inf

    return sorted(answers, key=per_token, reverse=True)[:n]


def merged_usage(usages: list[dict]) -> dict:
    """One usage for the choices: the prompt counted once (as OpenAI counts it), completion tokens and forward
    passes added up, tokens per forward over them all."""
    first, completion = usages[0], sum(u.get("completion_tokens", 0) for u in usages)
    usage = {**first, "completion_tokens": completion, "total_tokens": first.get("prompt_tokens", 0) + completion}
    if all("forward_passes" in u for u in usages):
        passes = sum(u["forward_passes"] for u in usages)
        usage["forward_passes"] = passes
        usage["tokens_per_forward"] = round(completion / max(passes, 1), 4)
    for drop in ("completion_tokens_details", "prompt_tokens_details", "mars_tau"):
        usage.pop(drop, None)  # per choice: not summed
    return usage


def merged_answer(answers: list[dict]) -> dict:
    """Whole answers of one choice each, as one answer of them all (the first one's id)."""
    merged = dict(answers[0])
    merged["choices"] = [{**answer["choices"][0], "index": i} for i, answer in enumerate(answers)]
    if all(answer.get("usage") for answer in answers):
        merged["usage"] = merged_usage([answer["usage"] for answer in answers])
    return merged


async def merged_stream(streams: list, request_id: str):
    """The SSE events of streams of one choice each, as one stream: each event as it comes, its choices under the
    stream's index and the first stream's id; the usages held back and sent summed in a last event of their own."""
    events: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        try:
            async for part in stream:
                for event in (part.decode() if isinstance(part, bytes) else part).split("\n\n"):
                    if event.strip():
                        await events.put((index, event))
        finally:
            await events.put((index, None))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    open_streams, usages, template = len(streams), [], None
    try:
        while open_streams:
            index, event = await events.get()
            if event is None:
                open_streams -= 1
                continue
            data = event.removeprefix("data: ").strip()
            if data == "[DONE]":
                continue
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                yield event + "\n\n"
                continue
            if "error" in chunk or "choices" not in chunk:
                yield event + "\n\n"
                continue
            chunk["id"], template = request_id, template or chunk
            for choice in chunk["choices"]:
                choice["index"] = index
            if chunk.get("usage"):
                usages.append(chunk.pop("usage"))
                if not chunk["choices"]:
                    continue
            yield f"data: {json.dumps(chunk)}\n\n"
        if usages and template is not None:
            yield f"data: {json.dumps({**template, 'choices': [], 'usage': merged_usage(usages)})}\n\n"
    finally:
        for task in tasks:
            task.cancel()
