"""`hf-mars distill` (recipe step 1): the base model answers the training prompts itself, greedily.

The first two stages of `hf-mars recipe` (the prompt mix, self-distillation) with the CPU recipe's defaults
(`hf_mars.tools.recipe.settings.DistillSettings`, read by TRL's parser like the recipe's); the same --output-dir
can be handed to `hf-mars recipe` afterwards, which skips them.
"""

from __future__ import annotations

from .recipe import add_command, parse_settings, stopped_message

HELP = "recipe step 1: the base model answers training prompts"
DESCRIPTION = (
    "Recipe step 1: a decontaminated mix of training prompts (docs/recipe.md) answered by the base model itself "
    "(greedy); writes prompts.jsonl, distilled.jsonl (all answers) and train.jsonl (finished answers). A run that "
    "--time-budget stopped continues when run again. --config FILE.yaml gives options in a YAML mapping; options "
    "on the command line override it."
)


def add_parser(subparsers) -> None:
    add_command(subparsers, "distill", HELP, DESCRIPTION, run)


def run(args) -> None:
    from ..tools.recipe.settings import DistillSettings

    config = parse_settings(DistillSettings, args.argv, "hf-mars distill", DESCRIPTION)  # --help: before torch loads
    from ..tools.data.distillation import write_reference_set
    from ..tools.recipe import steps as recipe

    prompts, done = recipe.distill_stages(config, recipe.Budget(config.time_budget))
    if not done:
        print(stopped_message(recipe.stages_left(config)))
    elif config.references:
        out = config.out / "train_reference.jsonl"
        count = write_reference_set(config.out / "train.jsonl", prompts, out)
        print(f"the same {count} prompts with the datasets' reference answers: wrote {out}")
