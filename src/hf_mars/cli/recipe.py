"""`hf-mars recipe`: the whole recipe in one command, sized for one GPU (prompts, self-distillation, MARS training,
export, evaluation), each stage skipped when its result is already in --output-dir.

The options are the fields of `hf_mars.tools.recipe.settings.Recipe`, read by TRL's `TrlParser` in `run` (so a YAML
`--config` works, and `--help` lists every default): argparse only names the command and hands the rest over.
"""

from __future__ import annotations

HELP = "the whole recipe on one GPU: distill, train, export, eval"
DESCRIPTION = (
    "The recipe in one command: a decontaminated prompt mix, self-distillation on the device, hf-mars train (LoRA "
    "or full), export and the τ table. Each stage is skipped when its result is in --output-dir: run the same "
    "command again (also in a copy of the folder on another machine) to continue an interrupted run, or one that "
    "--time-budget stopped. Defaults: one GPU, 512-token answers (docs/recipe.md). --config FILE.yaml gives "
    "options in a YAML mapping (output_dir: ..., prompts: ...); options on the command line override it."
)


def add_parser(subparsers) -> None:
    add_command(subparsers, "recipe", HELP, DESCRIPTION, run)


def add_command(subparsers, name: str, help: str, description: str, run) -> None:
    """Register a command whose arguments all go to `run` as `args.argv`: `prefix_chars` other than "-" makes
    argparse take `--output-dir` and `--help` as plain words, left to TRL's parser."""
    command = subparsers.add_parser(name, help=help, description=description, add_help=False, prefix_chars="+")
    command.add_argument("argv", nargs="*", help=f"options for TRL's parser (`hf-mars {name} --help` lists them)")
    command.set_defaults(run=run)


def parse_settings(settings_class, argv: list[str], prog: str, description: str):
    """`settings_class` from a command line (`--config FILE.yaml` first, then the options), by TRL's parser."""
    from trl import TrlParser

    parser = TrlParser([settings_class], prog=prog, description=description)
    (settings,) = parser.parse_args_and_config(args=argv)
    return settings


def run(args) -> None:
    from ..tools.recipe.settings import Recipe

    config = parse_settings(Recipe, args.argv, "hf-mars recipe", DESCRIPTION)  # --help answers before torch loads
    from ..tools.recipe import steps as recipe

    checkpoint = recipe.run(config)
    if checkpoint is None:
        print(stopped_message(recipe.stages_left(config)))
    else:
        print(f"MARS checkpoint: {checkpoint}")


def stopped_message(left: list[str]) -> str:
    return (
        f"Stopped by the time budget; not done yet: {', '.join(left)} (recipe.json). Run the same command again, in "
        "this folder or a copy of it on another machine, to continue."
    )
