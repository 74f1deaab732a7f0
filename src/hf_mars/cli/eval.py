"""`hf-mars eval` (recipe step 4): per τ, tokens per forward, the share of answers identical to τ = 1's (and to the
base model's with `--base`) and GSM8K / HumanEval accuracy, in one table (eval.md, eval.json) and a plot (eval.png)."""

from __future__ import annotations

HELP = "recipe step 4: tokens/forward and accuracy per τ, plotted"
DESCRIPTION = (
    "Recipe step 4: per τ, tokens/forward, the share of answers identical to τ = 1 (and to the base model with "
    "--base) and GSM8K/HumanEval accuracy; writes eval.md, eval.json and eval.png."
)


def add_parser(subparsers) -> None:
    ev = subparsers.add_parser("eval", help=HELP, description=DESCRIPTION)
    ev.add_argument("model", nargs="?", help="MARS checkpoint (default: the shipped one)")
    ev.add_argument("--taus", type=float, nargs="+", default=[1.0, 0.95, 0.9, 0.8, 0.7])
    ev.add_argument("--gsm8k", type=int, default=100, help="first N GSM8K test problems")
    ev.add_argument("--humaneval", type=int, default=50, help="first N HumanEval problems")
    ev.add_argument(
        "--base", action="store_true", help="also score the base model (the shipped base) with plain generate()"
    )
    ev.add_argument("--batch-size", type=int, default=16)
    ev.add_argument("--max-new-tokens", type=int, default=256)
    ev.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ev.add_argument("--device", help="e.g. cuda (default: where the model loads)")
    ev.add_argument("--output", default="outputs/eval", help="folder for eval.md, eval.json and eval.png")
    ev.set_defaults(run=run)


def run(args) -> None:
    import torch

    from ..tools.evals import evaluate_and_write
    from ..tools.loading import load_checkpoint

    model, tokenizer = load_checkpoint(args.model, None, args.dtype)
    base = _base_model(args.dtype) if args.base else None
    if args.device:
        model = model.to(args.device)
        base = base.to(args.device) if base is not None else None
    written = evaluate_and_write(
        model,
        tokenizer,
        args.output,
        name=args.model or "shipped",
        gsm8k=args.gsm8k,
        humaneval=args.humaneval,
        meta=dict(dtype=args.dtype, threads=torch.get_num_threads()),
        taus=args.taus,
        base_model=base,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
    )
    print("Wrote " + ", ".join(str(path) for path in written))


def _base_model(dtype: str):
    """The model the shipped checkpoint was trained from, scored with plain generate()."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..tools.shipped import base_checkpoint

    return AutoModelForCausalLM.from_pretrained(base_checkpoint(), dtype=getattr(torch, dtype)).eval()
