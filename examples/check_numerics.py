"""Does a forward over many tokens pick the same next tokens as one-token forwards? Per dtype.

    python examples/check_numerics.py [MODEL] [--dtypes float32 bfloat16] [--prompts 8] [--max-new-tokens 64]

Lossless mode (and transformers' prompt lookup) verify drafts with one pass over several tokens, and promise the
text of plain greedy `generate()`, which decodes one token per pass. The promise holds as far as the two kinds of
pass give the same argmax. This script decodes each held-out prompt greedily with `generate()`, then runs one
forward over prompt + answer and counts the positions where that forward's argmax differs from the decoded token.
"""

from __future__ import annotations

import argparse

import torch
from transformers import GenerationMixin

from hf_mars.bench import load_prompts
from hf_mars.cli import _load


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="MARS checkpoint (default: the shipped one)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=8, help="number of held-out prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    for dtype in args.dtypes:
        model, tok = _load(args.model, None, dtype)
        differ = total = 0
        for prompt in load_prompts("heldout", tok, limit=args.prompts):
            ids = tok(prompt["text"], return_tensors="pt", add_special_tokens=False).input_ids
            with torch.no_grad():
                out = GenerationMixin.generate(model, input_ids=ids, attention_mask=torch.ones_like(ids),
                                               max_new_tokens=args.max_new_tokens, do_sample=False)  # fmt: skip
                logits = model(out).logits[0, ids.shape[1] - 1 : -1]
            decoded = out[0, ids.shape[1] :]
            differ += int((logits.argmax(-1) != decoded).sum())
            total += decoded.numel()
        print(f"{dtype}: at {differ} of {total} positions the many-token forward's argmax differs from the token "
              f"decoded one pass at a time")  # fmt: skip


if __name__ == "__main__":
    main()
