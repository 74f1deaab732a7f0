"""`hf-mars export-delta` (recipe step 3): a LoRA MARS run stored as the delta that ships inside the package."""

from __future__ import annotations

HELP = "recipe step 3: a LoRA MARS run as the shipped delta"
DESCRIPTION = "Recipe step 3: store a LoRA MARS run as the shipped delta (float16, <= 25 MB)."


def add_parser(subparsers) -> None:
    exp = subparsers.add_parser("export-delta", help=HELP, description=DESCRIPTION)
    exp.add_argument("trained", help="output folder of `hf-mars train --use_peft ...`")
    exp.add_argument(
        "--output", help="folder to write the delta to (default: the package's checkpoints/smollm2-135m-mars)"
    )
    exp.set_defaults(run=run)


def run(args) -> None:
    from ..tools.checkpoints.shipped import DELTA_DIR, export_delta

    dst = export_delta(args.trained, args.output or DELTA_DIR)
    size = sum(f.stat().st_size for f in dst.iterdir()) / 2**20
    print(f"Wrote the delta to {dst} ({size:.1f} MB)")
