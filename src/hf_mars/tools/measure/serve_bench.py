"""`hf-mars bench --serve`: the server under N concurrent clients, MARS against plain decoding, in one run.

One server (this process, loopback) answers every mode: a request decodes plain when it sets no MARS field, with MARS
when it does, so the modes share the model, the batcher and the machine. For each client count the modes take turns,
round after round, so that drift of the machine falls on all alike. Clients arrive staggered and each streams its
requests one after another; a request's time to first token and its per-token latency (the time between its first and
last token over the tokens in between) are read on the client's side, as a user of the API sees them.

With `tau_range`, the modes are the load ramp of the τ policy (serving/load.py): plain, MARS at τ = 1, and MARS with
τ chosen from the load within the range; each row reports the τ the policy ran at and the share of its answers equal
to τ = 1's on the same prompts (greedy: τ = 1 is plain decoding's text), the quality the load bought speed with.
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

from ...serving import DEFAULT_CACHE_SLOTS
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
REFERENCE = "MARS τ = 1"  # the ramp's mode whose answers the others' are compared with
STAGGER_S = 0.05  # between two clients' first requests


def ramp_modes(lo: float, hi: float = 1.0) -> dict:
    """The τ policy's ramp: plain, MARS at τ = 1 (one token a pass), and MARS with τ chosen in [lo, hi]."""
    return {"plain": {}, REFERENCE: {"mars_tau": 1.0}, f"MARS τ in [{lo:g}, {hi:g}]": {"mars_tau": [lo, hi]}}


@dataclass
class Timing:
    ttft: float  # seconds to the first content token
    per_token: float  # seconds per token after the first
    tokens: int
    prompt: str = ""
    text: str = ""
    tau: float | None = None  # the mean τ its passes ran at, where the server chose it (usage.mars_tau)


def start_server(
    model: str,
    dtype: str,
    device: str,
    max_batch_size: int,
    compile: bool = False,
    cache_slots: int = DEFAULT_CACHE_SLOTS,
    attention: str | None = None,
    port: int = 0,
):
    """The app on a loopback port in a background thread: `(url, server)`; `server.should_exit = True` stops it."""
    hf_logging.set_verbosity_error()  # transformers serve logs every request as a warning
    app, engine = build_app(
        model, dtype, device, compile, max_batch_size, cache_slots=cache_slots, attention=attention
    )
    print("measuring this machine's pass costs (once; cached) before the clients start", flush=True)
    engine.measuring.join()  # lossless "auto" and the τ policy read them: the bench times what they choose
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
    first = last = tau = None
    tokens, parts = 0, []
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
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
            tau = (getattr(chunk.usage, "mars_tau", None) or {}).get("mean")
    first, last = first or time.perf_counter(), last or time.perf_counter()
    return Timing(first - start, (last - first) / max(tokens - 1, 1), tokens, prompt, "".join(parts), tau)


async def _round(url: str, model: str, fields: dict, clients: int, per_client: int, max_tokens: int):
    """`clients` concurrent clients, each sending `per_client` requests in turn: `(timings, wall seconds)`."""

    async def client_loop(index: int) -> list[Timing]:
        await asyncio.sleep(index * STAGGER_S)
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
    taus = [t.tau for t in timings if t.tau is not None]
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
        "tau_mean": statistics.fmean(taus) if taus else None,
        "tau_min": min(taus) if taus else None,
    }


def run_serve_bench(url, model, clients=(1, 4, 16), per_client=2, max_tokens=64, rounds=2, modes=MODES) -> list[dict]:
    """Every (clients, mode) measured over `rounds` interleaved rounds, after one untimed warm-up request per mode;
    then each prompt once more alone, plain, untimed: every row says the share of its answers equal to that (greedy
    decoding's text at batch 1, which a batch must not change: `same_as_alone`)."""

    for fields in modes.values():
        asyncio.run(_round(url, model, fields, 1, 1, 8))
    rows, answered = [], []
    steps = tqdm(total=len(clients) * rounds * len(modes), desc="serve bench", unit="round")
    for count in clients:
        gathered = {mode: ([], 0.0) for mode in modes}
        for _ in range(rounds):
            for mode, fields in modes.items():
                timings, wall = asyncio.run(_round(url, model, fields, count, per_client, max_tokens))
                gathered[mode] = (gathered[mode][0] + timings, gathered[mode][1] + wall)
                steps.update()
        answers = {t.prompt: t.text for t in gathered.get(REFERENCE, ([], 0))[0]}
        for mode in modes:
            rows.append(_summary(mode, count, *gathered[mode]))
            answered.append(gathered[mode][0])
            if answers:  # the share of its answers equal to τ = 1's on the same prompts
                timings = gathered[mode][0]
                rows[-1]["same_as_tau_1"] = statistics.fmean(t.text == answers[t.prompt] for t in timings)
    steps.close()
    alone = asyncio.run(_alone(url, model, {t.prompt for timings in answered for t in timings}, max_tokens))
    for row, timings in zip(rows, answered):
        row["same_as_alone"] = statistics.fmean(t.text == alone[t.prompt] for t in timings)
    return rows


async def _alone(url: str, model: str, prompts: set[str], max_tokens: int) -> dict[str, str]:
    """Each prompt's plain greedy answer with no other request running: `{prompt: text}`."""
    async with AsyncOpenAI(base_url=url, api_key="-", max_retries=0, timeout=600) as client:
        return {p: (await _one_request(client, model, p, {}, max_tokens)).text for p in sorted(prompts)}


def serve_table(rows: list[dict]) -> str:
    """Each row beside the plain row of its client count (the tokens/s ratio is the speed-up) and, in the τ ramp,
    beside τ = 1's, with the τ the server chose and the share of answers equal to τ = 1's."""
    plain = {r["clients"]: r["tokens_per_s"] for r in rows if r["mode"] == "plain"}
    one = {r["clients"]: r["tokens_per_s"] for r in rows if r["mode"] == REFERENCE}
    ramp = bool(one)
    head = ["clients", "mode", "req/s", "tok/s", "vs plain", "TTFT p50/p95 ms", "per-token p50/p95 ms", "= alone"]
    head += ["vs τ = 1", "τ mean (min)", "= τ 1 text"] if ramp else []
    body = []
    for r in rows:
        line = [
            str(r["clients"]),
            r["mode"],
            f"{r['requests_per_s']:.2f}",
            f"{r['tokens_per_s']:.1f}",
            _ratio(r["tokens_per_s"], plain.get(r["clients"])),
            f"{r['ttft_p50_ms']:.0f} / {r['ttft_p95_ms']:.0f}",
            f"{r['token_p50_ms']:.1f} / {r['token_p95_ms']:.1f}",
            f"{r['same_as_alone']:.0%}" if "same_as_alone" in r else "-",
        ]
        if ramp:
            tau = "-" if r.get("tau_mean") is None else f"{r['tau_mean']:.2f} ({r['tau_min']:.2f})"
            line += [_ratio(r["tokens_per_s"], one.get(r["clients"])), tau, f"{r.get('same_as_tau_1', 1.0):.0%}"]
        body.append(line)
    return markdown_table(head, body)


def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}x" if base else "-"


def serve_plot(rows: list[dict], path) -> None:
    """tokens/s of each mode against the clients, and (the ramp) the τ the policy chose and the answers it kept."""
    from .plots import figure, save_figure

    ramp = any(r.get("tau_mean") is not None for r in rows)
    labels = ["tokens/s"] + (["τ chosen (mean) / share of answers = τ 1's"] if ramp else [])
    plt, fig, axes = figure(labels, "concurrent clients", "The serve bench's plot needs matplotlib")
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        axes[0].plot([r["clients"] for r in mine], [r["tokens_per_s"] for r in mine], "o-", label=mode)
        if ramp and mine[0].get("tau_mean") is not None:
            clients = [r["clients"] for r in mine]
            axes[1].plot(clients, [r["tau_mean"] for r in mine], "o-", label=f"{mode}: τ")
            axes[1].plot(clients, [r.get("same_as_tau_1", 1.0) for r in mine], "s--", label=f"{mode}: = τ 1 text")
    clients = sorted({r["clients"] for r in rows})
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(clients, [str(c) for c in clients])
        ax.legend(fontsize=7)
    if ramp:
        axes[1].set_ylim(0, 1.05)
    save_figure(plt, fig, path)
