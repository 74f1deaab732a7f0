"""`hf-mars bench --serve`: the server under N concurrent clients, MARS against plain decoding, in one run.

One server (this process, loopback) answers both: a request decodes plain when it sets no MARS field, with MARS when
it does, so the two share the model, the batcher and the machine. For each client count the modes take turns, round
after round, so that drift of the machine falls on both alike. Each client streams its requests one after another;
a request's time to first token and its per-token latency (the time between its first and last token over the
tokens in between) are read on the client's side, as a user of the API sees them.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import threading
import time
from dataclasses import dataclass

import uvicorn
from openai import AsyncOpenAI
from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging

from ...serving.server import build_app
from .tables import markdown_table

# Requests of no evaluation set and not used to tune anything: a mix of code, arithmetic and prose
PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "What is 17 times 23? Show the steps.",
    "Explain in two sentences what a hash table is.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "List three differences between a list and a tuple in Python.",
    "A train travels 60 km in 45 minutes. What is its average speed in km/h?",
    "Write a haiku about the sea.",
    "Write a Python function that counts the vowels in a string.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Write a SQL query that selects the ten most recent orders from a table named orders.",
    "Explain what recursion is to a beginner.",
    "Write a Python function that merges two sorted lists into one sorted list.",
)
MODES = {"plain": {}, "MARS lossless": {"mars_verify": True}}


@dataclass
class Timing:
    ttft: float  # seconds to the first content token
    per_token: float  # seconds per token after the first
    tokens: int


def start_server(
    model: str, dtype: str, device: str, max_batch_size: int, compile: bool = False, cache_slots=None, port: int = 0
):
    """The app on a loopback port in a background thread: `(url, server)`; `server.should_exit = True` stops it."""
    hf_logging.set_verbosity_error()  # transformers serve logs every request as a warning
    app, _ = build_app(model, dtype, device, compile, max_batch_size, cache_slots=cache_slots)
    if not port:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}/v1", server


async def _one_request(client, model: str, prompt: str, fields: dict, max_tokens: int) -> Timing:
    start = time.perf_counter()
    first = last = None
    tokens = 0
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body=fields,
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    first, last = first or time.perf_counter(), last or time.perf_counter()
    return Timing(first - start, (last - first) / max(tokens - 1, 1), tokens)


async def _round(url: str, model: str, fields: dict, clients: int, per_client: int, max_tokens: int):
    """`clients` concurrent clients, each sending `per_client` requests in turn: `(timings, wall seconds)`."""

    async def client_loop(index: int) -> list[Timing]:
        async with AsyncOpenAI(base_url=url, api_key="-", max_retries=0, timeout=600) as client:
            prompts = [PROMPTS[(index * per_client + k) % len(PROMPTS)] for k in range(per_client)]
            return [await _one_request(client, model, p, fields, max_tokens) for p in prompts]

    start = time.perf_counter()
    results = await asyncio.gather(*[client_loop(i) for i in range(clients)])
    return [t for timings in results for t in timings], time.perf_counter() - start


def _summary(mode: str, clients: int, timings: list[Timing], wall: float) -> dict:
    def pct(values, q):
        return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]

    ttft, per_token = [t.ttft for t in timings], [t.per_token for t in timings]
    return {
        "mode": mode,
        "clients": clients,
        "requests": len(timings),
        "requests_per_s": len(timings) / wall,
        "tokens_per_s": sum(t.tokens for t in timings) / wall,
        "ttft_p50_ms": 1000 * pct(ttft, 50),
        "ttft_p95_ms": 1000 * pct(ttft, 95),
        "token_p50_ms": 1000 * pct(per_token, 50),
        "token_p95_ms": 1000 * pct(per_token, 95),
    }


def run_serve_bench(url, model, clients=(1, 4, 16), per_client=2, max_tokens=64, rounds=2, modes=MODES) -> list[dict]:
    """Every (clients, mode) measured over `rounds` interleaved rounds, after one untimed warm-up request per mode."""

    for fields in modes.values():
        asyncio.run(_round(url, model, fields, 1, 1, 8))
    rows = []
    steps = tqdm(total=len(clients) * rounds * len(modes), desc="serve bench", unit="round")
    for count in clients:
        gathered = {mode: ([], 0.0) for mode in modes}
        for _ in range(rounds):
            for mode, fields in modes.items():
                timings, wall = asyncio.run(_round(url, model, fields, count, per_client, max_tokens))
                gathered[mode] = (gathered[mode][0] + timings, gathered[mode][1] + wall)
                steps.update()
        rows += [_summary(mode, count, *gathered[mode]) for mode in modes]
    steps.close()
    return rows


def serve_table(rows: list[dict]) -> str:
    """Each row beside the plain row of its client count: the tokens/s ratio is the speed-up."""
    plain = {r["clients"]: r["tokens_per_s"] for r in rows if r["mode"] == "plain"}
    head = ["clients", "mode", "req/s", "tok/s", "vs plain", "TTFT p50/p95 ms", "per-token p50/p95 ms"]
    body = [
        [
            str(r["clients"]),
            r["mode"],
            f"{r['requests_per_s']:.2f}",
            f"{r['tokens_per_s']:.1f}",
            f"{r['tokens_per_s'] / plain[r['clients']]:.2f}x" if r["clients"] in plain else "-",
            f"{r['ttft_p50_ms']:.0f} / {r['ttft_p95_ms']:.0f}",
            f"{r['token_p50_ms']:.1f} / {r['token_p95_ms']:.1f}",
        ]
        for r in rows
    ]
    return markdown_table(head, body)
