"""`hf-mars demo`: train a toy MARS model on CPU in minutes, offline, then decode it and compare with AR."""

from __future__ import annotations

HELP = "train a toy MARS model on CPU, offline, then decode it"
DESCRIPTION = "Train a toy MARS model on CPU (minutes, offline), then decode and compare with AR."


def add_parser(subparsers) -> None:
    demo = subparsers.add_parser("demo", help=HELP, description=DESCRIPTION)
    demo.add_argument("--steps", type=int, default=800, help="training steps")
    demo.add_argument("--block-size", type=int, default=4, help="mars_block_size: at most B tokens per pass")
    demo.add_argument("--tau", type=float, default=0.9, help="τ of the wall-clock comparison (default 0.9)")
    demo.add_argument("--output-dir", default="outputs/mars-demo", help="folder the toy checkpoint is saved to")
    demo.set_defaults(run=run)


def run(args) -> None:
    from ..tools.checkpoints.demo import run_demo

    run_demo(steps=args.steps, block_size=args.block_size, output_dir=args.output_dir, tau=args.tau)
