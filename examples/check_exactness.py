"""Does lossless mode give plain greedy `generate()`'s tokens bit for bit? Per attention implementation and dtype.

    python examples/check_exactness.py [MODEL] [--attention sdpa eager ordered] [--dtype bfloat16]
        [--prompts 8] [--max-new-tokens 64] [--tree 2 3 4] [--cost-rounds 2]

For each attention implementation, plain greedy `generate()` decodes each held-out prompt alone (the reference), then
lossless mode with the draft tree `--tree B N L` and MARS at τ = 1 decode them alone and in left-padded batches of 4,
and plain `generate()` in batches of 4: each line counts the rows whose tokens equal the reference's, and the
seconds each took. `--cost-rounds` then times plain `generate()` (32 new tokens, batch 1 and 4) with each
implementation against the first, in interleaved rounds: the median ratio and its range.
"""

from __future__ import annotations

import argparse
import statistics
import time

from transformers import GenerationMixin

from hf_mars.tools.checkpoints.loading import load_checkpoint
from hf_mars.tools.evaluate.evals import load_prompts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="MARS checkpoint (default: the shipped one)")
    parser.add_argument("--attention", nargs="+", default=["sdpa", "eager", "ordered"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tree", type=int, nargs=3, default=[2, 3, 4], metavar=("B", "N", "L"))
    parser.add_argument("--cost-rounds", type=int, default=2, help="rounds of the cost comparison (0: none)")
    args = parser.parse_args()

    model, tok = load_checkpoint(args.model, dtype=args.dtype)
    tok.padding_side = "left"
    prompts = [p["text"] for p in load_prompts("heldout", tok, limit=args.prompts)]
    block, candidates, lookup = args.tree
    tree = dict(mars_verify=True, mars_tau=0.0, mars_block_size=block, mars_draft_candidates=candidates)
    modes = {f"lossless {block}x{candidates}+{lookup}": {**tree, "mars_lookup": lookup}, "τ = 1": {"mars_tau": 1.0}}
    for attention in args.attention:
        model.set_attn_implementation(attention)
        start = time.perf_counter()
        reference = [decode(model, tok, [p], {}, args.max_new_tokens)[0] for p in prompts]
        said = [f"plain b1 {time.perf_counter() - start:.0f} s"]
        for name, mars in [*modes.items(), ("plain", None)]:
            for batch in (1, 4) if mars is not None else (4,):
                start = time.perf_counter()
                rows = []
                for i in range(0, len(prompts), batch):
                    rows += decode(model, tok, prompts[i : i + batch], mars, args.max_new_tokens)
                same = sum(a == b for a, b in zip(rows, reference))
                said.append(f"{name} b{batch} {same}/{len(prompts)} ({time.perf_counter() - start:.0f} s)")
        print(f"{attention} ({args.dtype}): " + "; ".join(said), flush=True)
    if args.cost_rounds:
        cost(model, tok, prompts, args.attention, args.cost_rounds)


def decode(model, tok, prompts, mars: dict | None, new_tokens: int) -> list[list[int]]:
    """Each row's new tokens up to its EOS: plain `generate()` where `mars` is None."""
    enc = tok(prompts, return_tensors="pt", padding=True)
    if mars is None:
        out = GenerationMixin.generate(model, **enc, max_new_tokens=new_tokens, do_sample=False)
    else:
        out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, **mars)
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
