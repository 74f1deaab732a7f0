"""`hf-mars recipe`: the whole recipe in one command, sized for one GPU (prompts, self-distillation, MARS training,
export, evaluation), each stage skipped when its result is already in --output-dir."""

from __future__ import annotations

import shlex

HELP = "the whole recipe on one GPU: distill, train, export, eval"
DESCRIPTION = (
    "The recipe in one command: a decontaminated prompt mix, self-distillation on the device, hf-mars train (LoRA "
    "or full), export and the τ table. Each stage is skipped when its result is in --output-dir: run the same "
    "command again to continue an interrupted run. Defaults: one GPU, 512-token answers (docs/recipe.md)."
)


def add_parser(subparsers) -> None:
    rec = subparsers.add_parser("recipe", help=HELP, description=DESCRIPTION)
    rec.add_argument("--output-dir", required=True, help="every stage's results, and recipe.json (the settings)")
    add_data_arguments(rec, prompts=100_000, max_new_tokens=512, batch_size=None)
    train = rec.add_argument_group("training (hf-mars train)")
    train.add_argument("--full-finetune", action="store_true", help="train every weight (default: LoRA rank 32)")
    train.add_argument("--epochs", type=float, default=2.0)
    train.add_argument("--batch-size", type=int, default=32, help="examples per training step")
    train.add_argument("--learning-rate", type=float, help="default: 4e-4 with LoRA, 1e-4 for a full fine-tune")
    train.add_argument("--max-length", type=int, help="tokens per training example (default: --max-new-tokens + 512)")
    train.add_argument("--block-size", type=int, default=4, help="B, the masks predicted per pass")
    train.add_argument(
        "--train-args", default="", help='more hf-mars train (TRL) arguments, one string: "--save_steps 500"'
    )
    ev = rec.add_argument_group("evaluation (the τ table on GSM8K test and HumanEval)")
    ev.add_argument("--eval-gsm8k", type=int, default=256, help="first N GSM8K test problems (0 and 0: no eval)")
    ev.add_argument("--eval-humaneval", type=int, default=164, help="first N HumanEval problems")
    ev.add_argument("--eval-taus", type=float, nargs="+", default=[1.0, 0.95, 0.9, 0.8, 0.7])
    ev.add_argument("--eval-batch-size", type=int, default=64)
    ev.add_argument("--no-eval-base", action="store_true", help="do not score the base model's plain generate()")
    rec.set_defaults(run=run)


def add_data_arguments(parser, prompts: int, max_new_tokens: int, batch_size: int | None) -> None:
    """The options `hf-mars distill` and `hf-mars recipe` share: the prompt mix and the self-distillation."""
    data = parser.add_argument_group("prompts and self-distillation")
    data.add_argument("--prompts", type=int, default=prompts, help="training prompts in the mix")
    data.add_argument(
        "--sources",
        nargs="+",
        metavar="NAME[=SHARE]",
        help="prompt sources and their shares, e.g. math=0.4 mbpp gym (default: the mix in docs/recipe.md; "
        "gym:TASK for one reasoning-gym task; sciq and coqa_nc are non-commercial, opt-in)",
    )
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--model", help="base model folder (default: the shipped checkpoint's base, SmolLM2-135M)")
    data.add_argument("--device", default="auto", help="auto (cuda when there is one), cuda, cuda:1, cpu")
    data.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    data.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="longest answer kept")
    data.add_argument(
        "--distill-batch-size", type=int, default=batch_size, help="prompts per generate() (default: 512 GPU, 16 CPU)"
    )
    data.add_argument("--time-budget", type=float, help="seconds of self-distillation; the rest is left unanswered")


def check(args) -> None:
    """One-line refusals of values that would fail deep inside a stage."""
    for name in ("prompts", "max_new_tokens", "distill_batch_size", "batch_size", "max_length", "block_size"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.time_budget is not None and args.time_budget <= 0:
        raise ValueError(f"--time-budget must be positive, got {args.time_budget}")


def run(args) -> None:
    from ..tools import recipe

    check(args)
    config = recipe.Recipe.from_args(
        args,
        train_args=shlex.split(args.train_args),
        eval_taus=tuple(args.eval_taus),
        eval_base=not args.no_eval_base,
    )
    checkpoint = recipe.run(config)
    print(f"MARS checkpoint: {checkpoint}")
