"""`hf-mars push` and `hf-mars push-space`: a MARS checkpoint, or the Gradio Space that demonstrates it, to the Hub.

Both authenticate as huggingface_hub does: the HF_TOKEN environment variable, else `hf auth login`.
"""

from __future__ import annotations

PUSH_HELP = "upload a MARS checkpoint with a model card to the Hub"
PUSH_DESCRIPTION = "Upload a MARS checkpoint (safetensors, remote code, tokenizer) with a model card."
SPACE_HELP = "upload the Gradio Space, pointed at a MARS model repo"
SPACE_DESCRIPTION = "Upload the Gradio Space folder and point it at a MARS model repo."


def add_parser(subparsers) -> None:
    _add_push(subparsers)
    _add_push_space(subparsers)


def _add_push(subparsers) -> None:
    push = subparsers.add_parser("push", help=PUSH_HELP, description=PUSH_DESCRIPTION)
    push.add_argument("folder", help="a MARS checkpoint folder saved by hf_mars, tokenizer included")
    push.add_argument("repo_id", help="Hub model repo, namespace/name (created if missing)")
    push.add_argument("--private", action="store_true", help="create the repo private")
    push.add_argument("--revision", help="branch to commit to (created from main if missing)")
    push.add_argument("--base-model", help="card metadata (default: from the folder's README.md or config)")
    push.add_argument("--license", help="card metadata, e.g. apache-2.0 (default: from the folder's README.md)")
    push.add_argument("--dataset", action="append", help="card metadata; repeat for several datasets")
    push.add_argument("--tau-table", help="JSON file of measured rows {tau, tokens_per_forward, ...} for the card")
    push.add_argument("--commit-message", help="the Hub commit's message (default: Upload MARS checkpoint)")
    push.set_defaults(run=run)


def _add_push_space(subparsers) -> None:
    space = subparsers.add_parser("push-space", help=SPACE_HELP, description=SPACE_DESCRIPTION)
    space.add_argument("space_id", help="Hub Space, namespace/name (created if missing)")
    space.add_argument("--model", required=True, help="the MARS model repo the Space loads (its MARS_MODEL variable)")
    space.add_argument(
        "--model-revision", help="pin the model's revision (MARS_REVISION): its remote code runs in the Space"
    )
    space.add_argument("--folder", help="the Space's files (default: the project's spaces_demo/)")
    space.add_argument("--private", action="store_true", help="create the Space private")
    space.add_argument("--commit-message", help="the Hub commit's message (default: MARS demo for MODEL)")
    space.set_defaults(run=run)


def run(args) -> None:
    (run_space if args.command == "push-space" else run_push)(args)


def _hub_errors(push):
    """Hub refusals (no token, no write access, ...) as one line, like the library's ValueErrors."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return push()
    except HfHubHTTPError as err:
        raise SystemExit(f"hf-mars: the Hub refused: {err}") from err


def run_push(args) -> None:
    from ..hub import push_to_hub

    result = _hub_errors(
        lambda: push_to_hub(
            args.folder,
            args.repo_id,
            private=args.private or None,
            revision=args.revision,
            base_model=args.base_model,
            license=args.license,
            datasets=args.dataset,
            tau_table=args.tau_table,
            commit_message=args.commit_message,
        )
    )
    print(result.summary())
    pin = f", revision={result.commit_sha!r}"
    print(f"Load it with AutoModelForCausalLM.from_pretrained({args.repo_id!r}{pin}, trust_remote_code=True)")


def run_space(args) -> None:
    from ..hub import push_space

    result = _hub_errors(
        lambda: push_space(
            args.space_id,
            args.model,
            folder=args.folder,
            private=args.private or None,
            model_revision=args.model_revision,
            commit_message=args.commit_message,
        )
    )
    print(result.summary())
    pin = f", MARS_REVISION={args.model_revision}" if args.model_revision else ""
    print(f"Space variable MARS_MODEL={args.model}{pin}")
