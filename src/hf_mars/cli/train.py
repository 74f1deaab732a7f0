"""`hf-mars train`: TRL's sft.py arguments plus `--mars_block_size` and `--mars_ar_weight`.

TRL's own parser reads the arguments (`main` hands it everything after `train`, `--help` included), so this module
only lists the command in `hf-mars --help`.
"""

from __future__ import annotations

HELP = "train a MARS model: TRL sft.py arguments plus --mars_*"
DESCRIPTION = "Train a MARS model: TRL sft.py arguments plus --mars_block_size/--mars_ar_weight."


def add_parser(subparsers) -> None:
    subparsers.add_parser("train", help=HELP, description=DESCRIPTION, add_help=False)


def run(argv: list[str]) -> None:
    """Train from the raw arguments after `train`."""
    from ..training.train import run as train

    train(argv)
