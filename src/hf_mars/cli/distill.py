"""`hf-mars distill` (recipe step 1): the base model answers the training prompts itself, greedily.

The first two stages of `hf-mars recipe` (the prompt mix, self-distillation) with the CPU recipe's defaults; the
same --output-dir can be handed to `hf-mars recipe` afterwards, which skips them.
"""

from __future__ import annotations

from .recipe import add_data_arguments, check

HELP = "recipe step 1: the base model answers training prompts"
DESCRIPTION = (
    "Recipe step 1: a decontaminated mix of training prompts (docs/recipe.md) answered by the base model itself "
    "(greedy); writes prompts.jsonl, distilled.jsonl (all answers) and train.jsonl (finished answers)."
)


def add_parser(subparsers) -> None:
    dist = subparsers.add_parser("distill", help=HELP, description=DESCRIPTION)
    dist.add_argument("--output-dir", default="outputs/recipe", help="the prompts, the answers and recipe.json")
    add_data_arguments(dist, prompts=1000, max_new_tokens=192, batch_size=40)
    dist.add_argument(
        "--references",
        action="store_true",
        help="also write train_reference.jsonl: the same prompts, answered by the datasets' references",
    )
    dist.set_defaults(run=run)


def run(args) -> None:
    from ..tools import recipe
    from ..tools.distillation import write_reference_set

    check(args)
    config = recipe.Recipe.from_args(args)
    recipe.check_settings(config)
    prompts = recipe.make_prompts(config)
    recipe.self_distill(config, prompts)
    if args.references:
        out = config.out / "train_reference.jsonl"
        count = write_reference_set(config.out / "train.jsonl", prompts, out)
        print(f"the same {count} prompts with the datasets' reference answers: wrote {out}")
