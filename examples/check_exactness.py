"""Does lossless mode give plain greedy `generate()`'s tokens bit for bit? Per attention implementation and dtype.

    python examples/check_exactness.py [MODEL] [--attention sdpa eager ordered] [--dtype bfloat16]
        [--prompts 8] [--max-new-tokens 64] [--modes runner-ups+lookup tau-1] [--batches 1 4]
        [--caches dynamic] [--cost-rounds 2]

For each attention implementation, plain greedy `generate()` decodes each held-out prompt alone (the reference), then
each mode decodes them alone and in left-padded batches (`--batches`), on each cache: lossless mode with a chain of
drafts (B = 4), runner-ups (B = 2, 3 candidates), candidates per depth (B = 4, 3, 2, 2), prompt lookup (B = 2, 4
tokens), both (`runner-ups+lookup`: B = 2, 3 candidates, 4 lookup tokens), the checkpoint's lossless preset (the
shipped one's `mars_lossless="auto"`: the tree this machine's pass costs choose, or none), and MARS at τ = 1; plain
`generate()` in the same batches too. Each line counts the rows whose
tokens equal the reference's, and the seconds each took. `--cost-rounds` then times plain `generate()` (32 new tokens,
batch 1 and 4) with each implementation against the first, in interleaved rounds: the median ratio and its range.
"""

from __future__ import annotations

import argparse
import statistics
import time

from transformers import GenerationMixin

from hf_mars.tools.checkpoints.loading import load_checkpoint
from hf_mars.tools.evaluate.evals import load_prompts

LOSSLESS = dict(mars_verify=True, mars_tau=0.0)
MODES = {
    "chain": {**LOSSLESS, "mars_block_size": 4},
    "runner-ups": {**LOSSLESS, "mars_block_size": 2, "mars_draft_candidates": 3},
    "per-depth": {**LOSSLESS, "mars_block_size": 4, "mars_draft_candidates": [3, 2, 2]},
    "lookup": {**LOSSLESS, "mars_block_size": 2, "mars_lookup": 4},
    "runner-ups+lookup": {**LOSSLESS, "mars_block_size": 2, "mars_draft_candidates": 3, "mars_lookup": 4},
    "auto": {"mars_verify": True},  # the checkpoint's `mars_lossless` preset: "auto" in the shipped one
    "tau-1": {"mars_tau": 1.0},
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="MARS checkpoint (default: the shipped one)")
    parser.add_argument("--attention", nargs="+", default=["sdpa", "eager", "ordered"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--modes", nargs="*", default=["runner-ups+lookup", "tau-1"], choices=list(MODES), help="none: costs only"
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--caches", nargs="+", default=["dynamic"], choices=["dynamic", "static"])
    parser.add_argument("--cost-rounds", type=int, default=2, help="rounds of the cost comparison (0: none)")
    args = parser.parse_args()

    model, tok = load_checkpoint(args.model, dtype=args.dtype)
    tok.padding_side = "left"
    prompts = [p["text"] for p in load_prompts("heldout", tok, limit=args.prompts)]
    for attention in args.attention if args.modes else []:
        model.set_attn_implementation(attention)
        start = time.perf_counter()
        reference = [decode(model, tok, [p], None, args.max_new_tokens)[0] for p in prompts]
        print(f"{attention} ({args.dtype}): plain b1, the reference, {time.perf_counter() - start:.0f} s", flush=True)
        for cache in args.caches:
            said = []
            for name in [*args.modes, "plain"]:
                mars = MODES.get(name)
                for batch in args.batches if mars is not None else [b for b in args.batches if b > 1]:
                    start = time.perf_counter()
                    rows = []
                    for i in range(0, len(prompts), batch):
                        rows += decode(model, tok, prompts[i : i + batch], mars, args.max_new_tokens, cache)
                    same = sum(a == b for a, b in zip(rows, reference))
                    said.append(f"{name} b{batch} {same}/{len(prompts)} ({time.perf_counter() - start:.0f} s)")
                    print(f"  {attention} ({args.dtype}, {cache} cache): {said[-1]}", flush=True)
            print(f"{attention} ({args.dtype}, {cache} cache): " + "; ".join(said), flush=True)
    if args.cost_rounds:
        cost(model, tok, prompts, args.attention, args.cost_rounds)


def decode(model, tok, prompts, mars: dict | None, new_tokens: int, cache: str = "dynamic") -> list[list[int]]:
    """Each row's new tokens up to its EOS: plain `generate()` where `mars` is None."""
    enc = tok(prompts, return_tensors="pt", padding=True)
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    if mars is None:
        out = GenerationMixin.generate(model, **enc, max_new_tokens=new_tokens, do_sample=False, **extra)
    else:
        out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, **mars, **extra)
    rows = [row[enc.input_ids.shape[1] :].tolist() for row in out]
    eos = tok.eos_token_id
    return [row[: row.index(eos) + 1] if eos in row else row for row in rows]


def cost(model, tok, prompts, attentions, rounds: int, new_tokens: int = 32) -> None:
    """Plain `generate()`'s tokens per second with each attention, against the first, rounds taking turns."""
    for batch in (1, 4):
        enc = tok(prompts[:batch], return_tensors="pt", padding=True)
        rates = {a: [] for a in attentions}
        for round_ in range(rounds + 1):  # the first round warms up
            for attention in attentions:
                model.set_attn_implementation(attention)
                start = time.perf_counter()
                GenerationMixin.generate(model, **enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
                if round_:
                    rates[attention].append(batch * new_tokens / (time.perf_counter() - start))
        base = statistics.median(rates[attentions[0]])
        said = [
            f"{a} {statistics.median(r):.1f} tokens/s ({statistics.median(r) / base:.2f}x, "
            f"{min(r) / base:.2f}x to {max(r) / base:.2f}x)"
            for a, r in rates.items()
        ]
        print(f"plain generate(), batch {batch}, {new_tokens} new tokens: " + "; ".join(said), flush=True)


if __name__ == "__main__":
    main()
