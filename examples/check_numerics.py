"""Does a forward over many tokens pick the same next tokens as one-token forwards? Per dtype.

    python examples/check_numerics.py [MODEL] [--dtypes float32 bfloat16] [--prompts 8] [--max-new-tokens 64]
    python examples/check_numerics.py [MODEL] --first-difference [--width 8]

Lossless mode (and transformers' prompt lookup) verify drafts with one pass over several tokens, and promise the
text of plain greedy `generate()`, which decodes one token per pass. The promise holds as far as the two kinds of
pass give the same argmax. This script decodes each held-out prompt greedily with `generate()`, then runs one
forward over prompt + answer and counts the positions where that forward's argmax differs from the decoded token.

`--first-difference` finds where the two kinds of pass part: from the same cache, it feeds one token alone, then the
same token followed by `--width - 1` more, and names the first module (in call order) whose output for that token
differs, per dtype.
"""

from __future__ import annotations

import argparse

import torch
from transformers import GenerationMixin

from hf_mars.decoding.compat import CACHE_ARG
from hf_mars.tools.checkpoints.loading import load_checkpoint
from hf_mars.tools.evaluate.evals import load_prompts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="MARS checkpoint (default: the shipped one)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=8, help="number of held-out prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--first-difference", action="store_true", help="name the first module whose output differs")
    parser.add_argument("--width", type=int, default=8, help="tokens of the wide pass (--first-difference)")
    args = parser.parse_args()

    for dtype in args.dtypes:
        model, tok = load_checkpoint(args.model, dtype=dtype)
        if args.first_difference:
            print(f"{dtype}: {first_difference(model, tok, args.width)}")
            continue
        differ = total = 0
        for prompt in load_prompts("heldout", tok, limit=args.prompts):
            ids = tok(prompt["text"], return_tensors="pt", add_special_tokens=False).input_ids
            with torch.no_grad():
                out = GenerationMixin.generate(
                    model,
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=args.max_new_tokens,
                    do_sample=False,
                )
                logits = model(out).logits[0, ids.shape[1] - 1 : -1]
            decoded = out[0, ids.shape[1] :]
            differ += int((logits.argmax(-1) != decoded).sum())
            total += decoded.numel()
        print(
            f"{dtype}: at {differ} of {total} positions the many-token forward's argmax differs from the token "
            f"decoded one pass at a time"
        )


def first_difference(model, tok, width: int) -> str:
    """The first module whose output at a token differs between a one-token pass and a `width`-token pass."""
    from transformers import DynamicCache

    text = load_prompts("heldout", tok, limit=1)[0]["text"]
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    prefix, fed = ids[:, :-width], ids[:, -width:]
    outputs = {}

    def record(name):
        def hook(module, inputs, output):
            output = output[0] if isinstance(output, tuple) else output
            if isinstance(output, torch.Tensor) and output.dim() == 3:
                outputs.setdefault(name, []).append(output[0, 0].clone())  # the first fed token

        return hook

    handles = [module.register_forward_hook(record(name)) for name, module in model.named_modules() if name]
    try:
        with torch.no_grad():
            for tokens in (fed[:, :1], fed):  # the same cache before each
                cache = DynamicCache(config=model.config)
                model(prefix, **{CACHE_ARG: cache}, use_cache=True)
                outputs.clear()
                model(tokens, **{CACHE_ARG: cache}, use_cache=True)
                if tokens.shape[1] == 1:
                    alone = {name: values[0] for name, values in outputs.items()}
    finally:
        for handle in handles:
            handle.remove()
    for name, values in outputs.items():  # call order
        if not torch.equal(values[0], alone[name]):
            return f"first difference at {name} (max abs {(values[0] - alone[name]).abs().max().item():.3g})"
    return f"no module's output differs between a 1-token and a {width}-token pass"


if __name__ == "__main__":
    main()
