"""What the command line, the tools and the examples share: loading a MARS checkpoint, and a chat prompt as text.

Importing this module imports neither torch nor transformers (so `hf-mars --help` answers at once); the functions
import them when called. A checkpoint that cannot be loaded raises `CheckpointError`: one sentence saying what is
wrong and what to do, checked before transformers is asked, because the chained traceback transformers raises names
neither (a missing folder surfaces as "Repo id must be in the form ...", an unreachable Hub only after a long series
of retries).
"""

from __future__ import annotations

import os
from pathlib import Path

NOT_MARS_HINT = (
    "make one with `hf_mars.to_mars(model, tokenizer)` and MARS training (`hf-mars train`), "
    "or convert an authors' release with `hf-mars convert SRC DST`"
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded for a reason the user can fix; the message says which and how."""


def chat_text(tokenizer, messages: list[dict]) -> str:
    """The prompt as the model reads it: the chat template with the assistant's turn opened, or, for a tokenizer
    without a template (a base model), the last message's text."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return messages[-1]["content"]


def looks_local(name: str) -> bool:
    """Whether `name` can only be a path: a Hub id is `name` or `namespace/name`, never absolute, `~`- or
    `.`-relative, with a backslash or with two slashes."""
    return name.startswith(("/", "~", ".")) or "\\" in name or name.count("/") > 1 or os.path.isabs(name)


def resolve_checkpoint(model: str | None = None, revision: str | None = None) -> str:
    """Where to load `model` from: a local checkpoint folder, or a Hub repo id the Hub has answered for.

    `None` is the shipped checkpoint (built on first use). A Hub id is looked up in the local cache when
    `HF_HUB_OFFLINE` is set, and with one request otherwise; when that request gets no answer the cached copy is
    used if there is one. Raises `CheckpointError` for a missing folder, an unknown repo, or a Hub that is offline or
    unreachable with nothing cached.
    """
    if model is None:
        from .shipped import default_checkpoint

        return str(default_checkpoint())
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(
                f"{model} holds no config.json: pass a checkpoint folder (save_pretrained writes one)."
            )
        return str(path)
    if path.exists():
        raise CheckpointError(f"{model} is a file: pass the checkpoint's folder, the one that holds config.json.")
    if looks_local(model):
        raise CheckpointError(
            f"{model} does not exist: pass a MARS checkpoint folder or a Hub repo id (namespace/name)."
        )
    return _resolve_hub_id(model, revision)


def _resolve_hub_id(repo_id: str, revision: str | None) -> str:
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise CheckpointError(f"{repo_id} is neither a local folder nor a Hub repo id (namespace/name).") from None
    if constants.HF_HUB_OFFLINE:
        cached = _cached_snapshot(repo_id, revision)
        if cached is None:
            raise CheckpointError(
                f"{repo_id} is not a local folder, and HF_HUB_OFFLINE is set with no copy of it in "
                "the Hugging Face cache: unset HF_HUB_OFFLINE to download it, or pass a local "
                "folder."
            )
        return cached
    problem = _ask_hub(repo_id, revision)
    if problem is None:
        return repo_id
    cached = _cached_snapshot(repo_id, revision)
    if cached is None:
        raise CheckpointError(
            f"cannot reach the Hugging Face Hub to download {repo_id} ({problem}): check the "
            "connection, or pass a local folder."
        )
    return cached


def _ask_hub(repo_id: str, revision: str | None) -> str | None:
    """One request, no retries (downloads retry for tens of seconds): None when the Hub knows the repo, the problem
    when it did not answer; a refusal that no cached copy can mend raises."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        HfApi().model_info(repo_id, revision=revision, timeout=10)
    except GatedRepoError:
        gated = f"{repo_id} is gated: accept its conditions on its Hub page, then `hf auth login`."
        raise CheckpointError(gated) from None
    except RepositoryNotFoundError:
        raise CheckpointError(
            f"{repo_id} is neither a local folder nor a model on the Hub (a private repo needs `hf auth login`)."
        ) from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{repo_id} has no revision {revision!r} on the Hub.") from None
    except HfHubHTTPError as err:  # the Hub answered with an error of its own (5xx, rate limit): try the cache
        return str(err).splitlines()[0]
    except Exception as err:  # no answer at all: DNS, refused connection, timeout, proxy
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no answer'}"
    return None


def _cached_snapshot(repo_id: str, revision: str | None) -> str | None:
    """The local snapshot folder of a repo in the Hugging Face cache, if it holds a config.json; else None."""
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except Exception:  # huggingface_hub's LocalEntryNotFoundError and kin: not cached
        return None
    return folder if (Path(folder) / "config.json").is_file() else None


def check_mars_config(config: dict, name: str) -> None:
    """Refuse a config that is not a MARS model's, before its weights load, saying how to make one."""
    if config.get("model_type") == "a2d-qwen2":
        raise CheckpointError(
            f"{name} is an authors' MARS release (model_type a2d-qwen2): convert its folder first "
            "with `hf-mars convert SRC DST`, then load DST."
        )
    if config.get("mars_mask_token_id") is None:
        raise CheckpointError(
            f"{name} is not a MARS checkpoint (no mars_mask_token_id in its config): {NOT_MARS_HINT}."
        )


def load_checkpoint(model: str | None = None, revision: str | None = None, dtype="float32", attention=None):
    """Load a MARS checkpoint with this installed hf_mars's decoding code: `(model, tokenizer)`, model in eval mode.

    `model` is a local folder, a Hub repo id, or None for the shipped checkpoint (see `resolve_checkpoint`); `dtype`
    a torch dtype or its name; `attention` an attention implementation (None: transformers' default; `"ordered"`:
    `decoding/ordered_attention.py`, registered by importing `decoding.modeling` here). The checkpoint's own
    remote-code files are not run: its weights load as the plain base class, which then becomes the MARS class of
    this package. So no `trust_remote_code` is needed, and a checkpoint saved by an older hf_mars decodes with every
    feature of this one.
    """
    path = resolve_checkpoint(model, revision)  # before torch loads: a wrong name is answered at once
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

    from ...decoding.modeling import mars_class

    revision = None if Path(path).is_dir() else revision
    config, _ = PretrainedConfig.get_config_dict(path, revision=revision)
    check_mars_config(config, model or path)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
    chosen = {"attn_implementation": attention} if attention else {}
    loaded = AutoModelForCausalLM.from_pretrained(path, revision=revision, dtype=dtype, **chosen).eval()
    loaded.__class__ = mars_class(type(loaded))
    return loaded, tokenizer
