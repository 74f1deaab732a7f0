"""`hf-mars eval` (recipe step 4): per τ, tokens per forward, the share of answers identical to τ = 1's (and to the
base model's with `--base`) and GSM8K / HumanEval accuracy, in one table (eval.md, eval.json) and a plot (eval.png).
`--frontier`: the same for every decoding rule (τ-mode, lossless trees, typical acceptance, sampled), in
frontier.md, frontier.json and frontier.png, resumable (`tools/evaluate/frontier.py`)."""

from __future__ import annotations

from .options import draft_tree

SHIPPED_TREE = "2x2+6"  # the hand-tuned tree the frontier compares against
FRONTIER_TREES = (SHIPPED_TREE, "3x2,2", "4x3,2,2", "3x3+5")
TYPICAL_TREES = (SHIPPED_TREE, "3x3+5")

HELP = "recipe step 4: tokens/forward and accuracy per τ, plotted"
DESCRIPTION = (
    "Recipe step 4: per τ, tokens/forward, the share of answers identical to τ = 1 (and to the base model with "
    "--base) and GSM8K/HumanEval accuracy; writes eval.md, eval.json and eval.png."
)


def add_parser(subparsers) -> None:
    ev = subparsers.add_parser("eval", help=HELP, description=DESCRIPTION)
    ev.add_argument("model", nargs="?", help="MARS checkpoint (default: the shipped one)")
    ev.add_argument("--taus", type=float, nargs="+", default=[1.0, 0.95, 0.9, 0.8, 0.7], help="τ values to run")
    ev.add_argument("--gsm8k", type=int, default=100, help="first N GSM8K test problems")
    ev.add_argument("--humaneval", type=int, default=50, help="first N HumanEval problems")
    ev.add_argument(
        "--base", action="store_true", help="also score the base model (the shipped base) with plain generate()"
    )
    ev.add_argument("--batch-size", type=int, default=16, help="prompts decoded together")
    ev.add_argument("--max-new-tokens", type=int, default=256, help="most tokens to generate per answer")
    ev.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype to load the models in")
    ev.add_argument("--device", help="e.g. cuda (default: where the model loads)")
    ev.add_argument("--output", default="outputs/eval", help="folder for eval.md, eval.json and eval.png")
    frontier = ev.add_argument_group("the quality-speed frontier of every rule (--frontier)")
    frontier.add_argument(
        "--frontier",
        action="store_true",
        help="tokens/forward against quality for τ-mode (--taus), lossless trees (--trees) and typical acceptance "
        "(--typical-trees), greedy and sampled at --temperature; resumes a stopped run in --output",
    )
    frontier.add_argument(
        "--trees",
        type=draft_tree,
        nargs="+",
        metavar="BxN[+L]",
        help=f"lossless draft trees, exact (default: the shipped {SHIPPED_TREE}; per-depth trees that `hf-mars tune` "
        "proposes at widths 15 and 32; 3x3+5, width 30, a per-depth tree with a prompt-lookup branch)",
    )
    frontier.add_argument(
        "--typical-trees",
        type=draft_tree,
        nargs="*",
        metavar="BxN[+L]",
        help=f'trees verified by typical acceptance, mars_accept="typical" (default: {SHIPPED_TREE} 3x3+5)',
    )
    frontier.add_argument(
        "--temperature", type=float, default=0.7, help="also sample lossless and typical at this temperature (0: no)"
    )
    frontier.add_argument(
        "--only",
        nargs="+",
        metavar="SETTING",
        help='decode only these of the settings the flags name, and τ = 1: e.g. tau=0.8 "lossless 2x1,T=0.7" '
        '"typical 3x3+5" (the table still holds every setting in --output)',
    )
    frontier.add_argument(
        "--join",
        nargs="+",
        default=[],
        metavar="FRONTIER_JSON",
        help="add the rows of earlier runs' frontier.json (same sets, dtype, batch size and budget) for settings "
        "--output lacks, to the table and the plot",
    )
    ev.set_defaults(run=run)


def run(args) -> None:
    import torch

    from ..tools.checkpoints.loading import load_checkpoint
    from ..tools.evaluate.evals import evaluate_and_write

    model, tokenizer = load_checkpoint(args.model, None, args.dtype)
    base = _base_model(args.dtype) if args.base else None
    if args.device:
        model = model.to(args.device)
        base = base.to(args.device) if base is not None else None
    if args.frontier:
        if base is not None:
            raise SystemExit("--base scores the base model per τ; the frontier compares MARS's rules (drop --base).")
        written = _frontier(model, tokenizer, args)
        print("Wrote " + ", ".join(str(path) for path in written))
        return
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

    from ..tools.checkpoints.shipped import base_checkpoint

    return AutoModelForCausalLM.from_pretrained(base_checkpoint(), dtype=getattr(torch, dtype)).eval()


def _frontier(model, tokenizer, args) -> list:
    import torch

    from ..tools.evaluate.evals import eval_prompts
    from ..tools.evaluate.frontier import (
        earlier_rows,
        format_frontier,
        frontier_settings,
        join,
        only,
        run_frontier,
        write_frontier,
    )

    rows = eval_prompts(args.gsm8k, args.humaneval)
    trees = args.trees if args.trees is not None else [draft_tree(t) for t in FRONTIER_TREES]
    typical = args.typical_trees if args.typical_trees is not None else [draft_tree(t) for t in TYPICAL_TREES]
    settings = frontier_settings(model, args.taus, trees, typical, args.temperature)
    name = args.model or "shipped"
    meta = dict(model=name, gsm8k=args.gsm8k, humaneval=args.humaneval, dtype=args.dtype, device=str(model.device))
    run_meta = dict(meta, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens)
    try:  # before hours of decoding
        settings = only(settings, args.only) if args.only else settings
        earlier = [row for path in args.join for row in earlier_rows(path, run_meta)]
    except (ValueError, OSError, KeyError) as err:
        raise SystemExit(str(err)) from None
    results = run_frontier(model, tokenizer, rows, settings, args.output, meta, args.batch_size, args.max_new_tokens)
    results = join(results, earlier)
    print(format_frontier(results))
    title = f"{name}: {args.gsm8k} GSM8K, {args.humaneval} HumanEval, {args.dtype}, batch {args.batch_size}"
    return write_frontier(results, args.output, dict(run_meta, threads=torch.get_num_threads()), title)
