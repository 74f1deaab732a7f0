"""`hf-mars distill` (recipe step 1): the base model answers the training prompts itself, greedily."""

from __future__ import annotations

from pathlib import Path

HELP = "recipe step 1: the base model answers training prompts"
DESCRIPTION = "Recipe step 1: training prompts answered by the base model itself (greedy)."


def add_parser(subparsers) -> None:
    dist = subparsers.add_parser("distill", help=HELP, description=DESCRIPTION)
    dist.add_argument(
        "--output-dir", default="outputs/recipe", help="writes distilled.jsonl (all) and train.jsonl (finished)"
    )
    dist.add_argument("--n-math", type=int, default=450, help="reasoning-gym gsm_symbolic problems")
    dist.add_argument(
        "--n-gym", type=int, default=250, help="short reasoning-gym tasks, spread over several generators"
    )
    dist.add_argument("--n-code", type=int, default=300, help="MBPP problems")
    dist.add_argument("--max-new-tokens", type=int, default=192)
    dist.add_argument("--batch-size", type=int, default=40)
    dist.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    dist.add_argument("--seed", type=int, default=0)
    dist.add_argument(
        "--references",
        action="store_true",
        help="also write train_reference.jsonl: the same prompts, answered by the datasets' references",
    )
    dist.set_defaults(run=run)


def run(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..tools.data import distill, training_prompts, write_reference_set, write_training_set
    from ..tools.shipped import base_checkpoint

    base = base_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, args.dtype)).eval()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = training_prompts(args.n_math, args.n_gym, args.n_code, seed=args.seed)
    distill(
        model,
        tokenizer,
        prompts,
        out / "distilled.jsonl",
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
    )
    kept, total = write_training_set(out / "distilled.jsonl", out / "train.jsonl")
    print(f"{kept} of {total} answers finished within {args.max_new_tokens} tokens: wrote {out / 'train.jsonl'}")
    if args.references:
        count = write_reference_set(out / "train.jsonl", prompts, out / "train_reference.jsonl")
        print(f"the same {count} prompts with the datasets' reference answers: wrote {out / 'train_reference.jsonl'}")
