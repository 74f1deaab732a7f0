"""How long the server's CPU needs just to read the prompts of `hf-mars bench --serve`'s first round: a floor under
the time to first token of its last client, whatever the order in which requests are admitted.

    python examples/serve_prompt_floor.py [MODEL] [--clients 16] [--dtypes bfloat16 float32]

For each dtype: the prompts of the first request of each of `--clients` clients (the bench's list, its chat
template), read one at a time and as one left-padded batch, each the faster of two forwards.
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_mars.tools.checkpoints.loading import load_checkpoint
from hf_mars.tools.measure.serve_bench import PROMPTS


@torch.inference_mode()
def seconds(model, batch) -> float:
    """The faster of two forwards over `batch` (the prompt's pass: logits for the last position only)."""
    times = []
    for _ in range(2):
        start = time.perf_counter()
        model(**batch, logits_to_keep=1)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="MARS checkpoint (default: the shipped one)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    args = parser.parse_args()
    for dtype in args.dtypes:
        model, tokenizer = load_checkpoint(args.model, dtype=dtype)
        chats = [[{"role": "user", "content": PROMPTS[(2 * i) % len(PROMPTS)]}] for i in range(args.clients)]
        texts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats]
        rows = [tokenizer(text, return_tensors="pt", add_special_tokens=False) for text in texts]
        seconds(model, rows[0])  # warm-up
        alone = [seconds(model, row) for row in rows]
        tokenizer.padding_side = "left"
        together = seconds(model, tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False))
        lengths = [row["input_ids"].shape[1] for row in rows]
        print(
            f"{dtype}: {args.clients} prompts of {min(lengths)} to {max(lengths)} tokens; one at a time "
            f"{sum(alone):.2f} s in all ({min(alone):.2f} to {max(alone):.2f} s each); as one batch {together:.2f} s"
        )


if __name__ == "__main__":
    main()
