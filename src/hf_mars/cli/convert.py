"""`hf-mars convert`: an authors' MARS checkpoint (model_type a2d-qwen2) as an hf_mars checkpoint."""

from __future__ import annotations

HELP = "convert an authors' MARS checkpoint (a2d-qwen2)"
DESCRIPTION = "Convert an authors' MARS checkpoint (model_type a2d-qwen2)."


def add_parser(subparsers) -> None:
    conv = subparsers.add_parser("convert", help=HELP, description=DESCRIPTION)
    conv.add_argument("src", help="folder of the authors' checkpoint")
    conv.add_argument("dst", help="folder to write the hf_mars checkpoint to")
    conv.add_argument(
        "--block-size", type=int, help="B the checkpoint was trained with (default: from its config, else 4)"
    )
    conv.add_argument("--tau", type=float, help="default τ to store in the generation config")
    conv.set_defaults(run=run)


def run(args) -> None:
    from ..convert import convert_checkpoint

    dst = convert_checkpoint(args.src, args.dst, block_size=args.block_size, tau=args.tau)
    print(f"Wrote {dst}: load it with AutoModelForCausalLM.from_pretrained({str(dst)!r}, trust_remote_code=True)")
