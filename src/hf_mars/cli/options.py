"""Argument types and options several commands share. Standard library only: every command's parser is built for
`hf-mars --help`, which must not wait for torch."""

from __future__ import annotations

import argparse

DTYPES = ["float32", "bfloat16", "float16"]
MODEL_HELP = "MARS checkpoint: a local folder or a Hub repo id (default: the shipped one)"


def mask_cost(text: str):
    """`mars_mask_cost` from the command line: a number >= 0, or `auto` (measured on this machine first)."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number >= 0 or `auto`, not {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"a number >= 0 or `auto`, not {text!r}")
    return value


def draft_tree(text: str) -> tuple[int, int, int]:
    """`BxN` or `BxN+L` (see `hf_mars.decoding.costs.parse_tree`), refused as argparse refuses a bad value."""
    from ..decoding.costs import parse_tree  # imports torch: only once a tree is given, so --help stays fast

    try:
        return parse_tree(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_model(parser: argparse.ArgumentParser, help: str = MODEL_HELP) -> None:
    parser.add_argument("model", nargs="?", help=help)


def add_machine(parser: argparse.ArgumentParser, dtype_help: str | None = None) -> None:
    """Where and how `bench` and `tune` load the model: revision, dtype, device."""
    parser.add_argument("--revision")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["auto", *DTYPES],
        help=dtype_help or "default float32; `auto`: where lossless decoding is expected fastest here (says why)",
    )
    parser.add_argument("--device", help="e.g. cuda (default: where the model loads)")


def add_tau_range(parser, help: str) -> None:
    """`--tau-range LO HI`: a τ range the server chooses τ in from its load (checked where the command runs)."""
    parser.add_argument("--tau-range", type=float, nargs=2, metavar=("LO", "HI"), help=help)
