"""Argument types and options several commands share. Standard library only: every command's parser is built for
`hf-mars --help`, which must not wait for torch."""

from __future__ import annotations

import argparse

DTYPES = ["float32", "bfloat16", "float16"]
ATTENTIONS = ["sdpa", "eager", "ordered"]
ATTENTION_HELP = (
    "attention implementation, MARS and plain decoding alike (default: the checkpoint's, sdpa); ordered: a token's "
    "bits whatever the pass or batch holds, so lossless output is generate()'s in bfloat16 too, at a cost "
    "(docs/decoding.md)"
)
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


def add_attention(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--attention", choices=ATTENTIONS, help=ATTENTION_HELP)


def add_machine(parser: argparse.ArgumentParser, dtype_help: str | None = None) -> None:
    """Where and how `bench` and `tune` load the model: revision, dtype, attention, device."""
    parser.add_argument("--revision", help="pin a Hub revision: remote code runs on your machine")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["auto", *DTYPES],
        help=dtype_help or "default float32; `auto`: where lossless decoding is expected fastest here (says why)",
    )
    add_attention(parser)
    parser.add_argument("--device", help="e.g. cuda (default: where the model loads)")


def add_decoding(parser: argparse.ArgumentParser, temperature_help: str) -> None:
    """How plain decoding and MARS choose tokens, alike: `--temperature`, `--top-p`, `--repetition-penalty`
    (`decoding_kwargs` reads them)."""
    parser.add_argument("--temperature", type=float, help=temperature_help)
    parser.add_argument(
        "--top-p", type=float, help="with --temperature: nucleus sampling's p (default: the model's generation config)"
    )
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        help="every run decodes with this repetition penalty (MARS's lossless text stays plain's); default: none",
    )


def decoding_kwargs(args) -> dict:
    """`generate()` keywords of `add_decoding`'s options (none given: greedy), or `SystemExit` saying what is wrong."""
    out = {}
    if args.temperature is not None:
        if not args.temperature > 0:
            raise SystemExit(f"--temperature must be above 0 (sampling), got {args.temperature}: omit it for greedy.")
        out.update(do_sample=True, temperature=args.temperature)
    if args.top_p is not None:
        if args.temperature is None or not 0 < args.top_p <= 1:
            raise SystemExit(f"--top-p must be in (0, 1] and comes with --temperature, got {args.top_p}.")
        out.update(top_p=args.top_p)
    if args.repetition_penalty is not None:
        if not args.repetition_penalty > 0:
            raise SystemExit(f"--repetition-penalty must be above 0, got {args.repetition_penalty}.")
        out.update(repetition_penalty=args.repetition_penalty)
    return out


def describe_decoding(args) -> str:
    """`add_decoding`'s options as a run says them: `sampled at T = 0.7, top-p 0.9, repetition penalty 1.2`, or ''."""
    said = [f"sampled at T = {args.temperature}"] if args.temperature is not None else []
    said += [f"top-p {args.top_p}"] if args.top_p is not None else []
    said += [f"repetition penalty {args.repetition_penalty}"] if args.repetition_penalty is not None else []
    return ", ".join(said)


def add_tau_range(parser, help: str) -> None:
    """`--tau-range LO HI`: a τ range the server chooses τ in from its load (checked where the command runs)."""
    parser.add_argument("--tau-range", type=float, nargs=2, metavar=("LO", "HI"), help=help)
