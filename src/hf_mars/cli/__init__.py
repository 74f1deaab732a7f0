"""`hf-mars`: the command line. One module per command, each with `add_parser(subparsers)`, which registers the
command's options, and `run(args)`, which does the work.

Command modules import the standard library only; torch and transformers load inside `run`. So `hf-mars --help`,
a command's `--help` and a mistyped option answer at once.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import sys

# Modules, in the order `hf-mars --help` lists their commands (`push` registers push and push-space).
COMMANDS = (
    "generate",
    "serve",
    "train",
    "demo",
    "bench",
    "tune",
    "distill",
    "export_delta",
    "eval",
    "recipe",
    "convert",
    "push",
)

DESCRIPTION = "MARS multi-token decoding for Hugging Face causal LMs: decode, measure, train, convert and publish."
EPILOG = """examples:
    hf-mars generate [MODEL] [--prompt "..."] [--tau 0.9] [--lossless [--draft-candidates N] [--lookup L]]
    hf-mars serve [MODEL] [--port 8000] [--max-batch-size 8]    (OpenAI-compatible; mars_tau etc. per request)
    hf-mars tune [MODEL] [--limit 8] [--trees 2x3+4 ...] [--save]    (the fastest lossless draft tree on this machine)
    hf-mars train --model_name_or_path M --dataset_name D --output_dir O [TRL SFT arguments] [--mars_block_size 4]
    hf-mars recipe --output-dir OUT [--prompts 100000] [--max-new-tokens 512] [--full-finetune] [--time-budget S]
    hf-mars demo [--steps 800] [--block-size 4] [--output-dir outputs/mars-demo]
    hf-mars convert SRC DST [--block-size 4] [--tau 0.9]
    hf-mars push DIR REPO_ID [--private] [--revision BRANCH] [--tau-table FILE] [--base-model ID] [--license L]
    hf-mars push-space SPACE_ID --model REPO_ID [--folder DIR] [--model-revision REV] [--private]

`hf-mars COMMAND --help` lists a command's options. Hub commands authenticate as huggingface_hub does: the HF_TOKEN
environment variable, else `hf auth login`.
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every command's description on its name's line: argparse (before Python 3.13) sizes the name column without
    the extra indent of command names, and would wrap `export-delta`'s description onto a line of its own."""

    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=20)
        self._action_max_length = 18  # the indent of command names (4) + "export-delta" + 2


class _CommandHelpFormatter(argparse.HelpFormatter):
    """A command's `--help`: an option's default after its help, where it has one (not None or False) and the help
    does not say it already (argparse's ArgumentDefaultsHelpFormatter appends it even to a "default: ..." help)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        default = action.default
        unset = any(default is none for none in (None, False, argparse.SUPPRESS))  # `is`: 0 == False is shown
        if not action.option_strings or unset or "default" in help.lower():
            return help
        if isinstance(default, (list, tuple)):
            default = " ".join(map(str, default))
        shown = str(default).replace("%", "%%") or "none"  # help strings are %-formatted
        return f"{help} (default: {shown})" if help else f"default: {shown}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-mars", description=DESCRIPTION, epilog=EPILOG, formatter_class=_HelpFormatter
    )
    subparsers = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="COMMAND",
        title="commands",
        parser_class=functools.partial(argparse.ArgumentParser, formatter_class=_CommandHelpFormatter),
    )
    for name in COMMANDS:
        importlib.import_module(f".{name}", __name__).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> None:
    from_shell = argv is None  # the `hf-mars` command itself, not a caller in a longer-lived process
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:  # TRL's own parser takes the rest (argparse would claim --help and friends)
        from .train import run

        return run(argv[1:])
    args = build_parser().parse_args(argv)
    if getattr(args, "tau", None) is not None and not 0.0 <= args.tau <= 1.0:
        raise SystemExit(f"--tau must be in [0, 1], got {args.tau}")
    try:
        args.run(args)
    except (ValueError, FileNotFoundError) as err:  # bad or missing input named by the library: one line, no traceback
        raise SystemExit(f"hf-mars: {err}") from err
    # The interpreter's collections at exit walk every object torch and transformers made, seconds of a short
    # command on a small CPU; frozen, they are freed with the process. atexit hooks still run.
    if from_shell:
        gc.freeze()


if __name__ == "__main__":
    main()
