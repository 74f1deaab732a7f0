"""`hf-mars serve`: an OpenAI-compatible server decoding with MARS, many clients batched together."""

from __future__ import annotations

import logging

from .options import DTYPES, add_model

HELP = "serve a MARS checkpoint over an OpenAI-compatible HTTP API"
DESCRIPTION = (
    "Serve a MARS checkpoint with transformers serve's OpenAI-compatible API (/v1/chat/completions, /v1/completions, "
    "/v1/models, /health). Requests choose MARS per call with mars_tau, mars_verify and the draft-tree fields (as "
    "top-level fields, e.g. an OpenAI client's extra_body, or in a generation_config JSON string); the checkpoint's "
    "generation config is the default. Requests join the running batch between passes and leave it the moment they "
    "stop (continuous batching). See docs/serving.md."
)


def add_parser(subparsers) -> None:
    serve = subparsers.add_parser("serve", help=HELP, description=DESCRIPTION)
    add_model(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="default: the checkpoint's")
    serve.add_argument("--device", default="auto", help="e.g. cpu, cuda, cuda:1 (default: accelerate's choice)")
    serve.add_argument("--compile", action="store_true", help="static cache and torch.compile, as transformers serve")
    serve.add_argument("--max-batch-size", type=int, default=8, help="most requests decoding at once")
    serve.add_argument(
        "--continuous-batching",
        action="store_true",
        help="accepted, as transformers serve takes it: hf-mars serve always admits requests between passes",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(run=run)


def run(args) -> None:
    if args.max_batch_size < 1:
        raise ValueError(f"--max-batch-size must be at least 1, got {args.max_batch_size}")
    from ..tools.checkpoints.loading import resolve_checkpoint

    model = args.model or resolve_checkpoint(None)
    import uvicorn
    from transformers.utils import logging as hf_logging

    from ..serving.server import build_app

    hf_logging.set_verbosity_error()  # transformers serve logs every request as a warning
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", level=args.log_level.upper())  # hf_mars' own
    app, _ = build_app(model, args.dtype, args.device, args.compile, args.max_batch_size)
    print(f"hf-mars serve: {model} on http://{args.host}:{args.port}/v1 (model name: {model})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
