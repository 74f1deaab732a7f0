"""Plain requests alone, then beside requests for JSON under a schema, on `hf-mars serve` (started here, loopback):
what the plain clients' latency does when schema traffic shares the server, and whether every schema output
validates. Rounds alternate (alone, beside, alone, ...), so drift of the machine falls on both.

    python examples/serve_mixed_load.py [MODEL] [--clients 8] [--per-client 2] [--max-tokens 64] [--rounds 2]
                                        [--cache-slots N]

Every request decodes in lossless mode. The schemas and prompts are `hf-mars bench --structured`'s; the plain
prompts `hf-mars bench --serve`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import jsonschema
from openai import AsyncOpenAI

from hf_mars.serving import DEFAULT_CACHE_SLOTS
from hf_mars.tools.checkpoints.loading import resolve_checkpoint
from hf_mars.tools.measure.serve_bench import PROMPTS, start_server
from hf_mars.tools.measure.structured import _ASKS, _SUBJECTS, SCHEMAS

LOSSLESS = {"mars_verify": True}


async def plain(client, model: str, index: int, max_tokens: int) -> tuple[float, float, float]:
    """One streamed plain request: `(seconds to its first token, seconds per token after it, seconds in all)`."""
    start, first, last, tokens = time.perf_counter(), None, None, 0
    messages = [{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}]
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True, extra_body=LOSSLESS
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first, tokens = first or last, tokens + 1
    first, last = first or time.perf_counter(), last or time.perf_counter()
    return first - start, (last - first) / max(tokens - 1, 1), last - start


async def constrained(client, model: str, index: int, max_tokens: int) -> bool:
    """One request for JSON under a schema: whether its answer validates."""
    kind = list(SCHEMAS)[index % len(SCHEMAS)]
    subject = list(_SUBJECTS[kind])[(index // len(SCHEMAS)) % len(_SUBJECTS[kind])]
    reply = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": _ASKS[kind].format(subject)}],
        max_tokens=max_tokens,
        response_format={"type": "json_schema", "json_schema": {"name": kind, "schema": SCHEMAS[kind]}},
        extra_body=LOSSLESS,
    )
    try:
        jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMAS[kind])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def round_of(url: str, model: str, clients: int, per_client: int, max_tokens: int, beside: bool):
    """`clients` plain clients, each sending `per_client` requests one after another (so that later ones meet the
    schema requests wherever those are), and as many schema clients at once where `beside`: `(plain timings, schema
    validity)`."""

    async with AsyncOpenAI(base_url=url, api_key="-", max_retries=0, timeout=1800) as client:

        async def one_client(i: int) -> list:
            return [await plain(client, model, i * per_client + k, max_tokens) for k in range(per_client)]

        jobs = [one_client(i) for i in range(clients)]
        jobs += [constrained(client, model, i, 2 * max_tokens) for i in range(clients if beside else 0)]
        results = await asyncio.gather(*jobs)
    return [t for timings in results[:clients] for t in timings], results[clients:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="a MARS checkpoint (default: the shipped one)")
    parser.add_argument("--clients", type=int, default=8, help="plain clients, and as many schema clients beside")
    parser.add_argument("--per-client", type=int, default=2, help="plain requests each plain client sends in turn")
    parser.add_argument("--max-tokens", type=int, default=64, help="plain requests' (schema requests: twice)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--cache-slots",
        type=int,
        default=DEFAULT_CACHE_SLOTS,
        help=f"the eager runner's slots per row, as `hf-mars serve --cache-slots` (default {DEFAULT_CACHE_SLOTS})",
    )
    args = parser.parse_args()
    model = args.model or resolve_checkpoint(None)
    url, server = start_server(model, args.dtype, "cpu", 2 * args.clients, cache_slots=args.cache_slots)
    gathered = {False: [], True: []}
    valid = total = 0
    try:
        for _ in range(args.rounds):
            for beside in (False, True):
                round_args = (url, model, args.clients, args.per_client, args.max_tokens, beside)
                timings, answers = asyncio.run(round_of(*round_args))
                gathered[beside] += timings
                valid, total = valid + sum(answers), total + len(answers)
    finally:
        server.should_exit = True
    for beside, timings in gathered.items():
        first, per_token, whole = (statistics.median(t[k] for t in timings) for k in range(3))
        name = "beside schema requests" if beside else "alone"
        print(
            f"plain {name}: first token p50 {1000 * first:.0f} ms, per token p50 {1000 * per_token:.1f} ms, "
            f"request p50 {whole:.2f} s ({len(timings)} requests)"
        )
    print(f"schema outputs valid: {valid}/{total}")


if __name__ == "__main__":
    main()
