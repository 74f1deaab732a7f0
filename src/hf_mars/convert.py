"""Turning models into MARS models: `to_mars` for any causal LM, `convert_checkpoint` for the authors' releases."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.utils import logging as transformers_logging

from .decoding.modeling import MASK_TOKEN, mars_class, set_mask_token
from .decoding.settings import CONFIDENCE_MEASURES, check_tau

logger = logging.getLogger(__name__)


def add_mask_token(model: PreTrainedModel, tokenizer) -> int:
    """Give the tokenizer a `<|mask|>` token and the model an embedding row for it; return its id.

    Where the embedding matrix is padded past the vocabulary (Qwen2.5: 151,665 tokens in 151,936 rows) the token
    takes a spare row: no resize, no new parameters. Otherwise the matrix grows by one row (mean-initialised).
    """
    if MASK_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"extra_special_tokens": [MASK_TOKEN]}, replace_extra_special_tokens=False)
    mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    rows = model.get_input_embeddings().weight.shape[0]
    if mask_id >= rows:
        logger.warning(
            "%s has no spare embedding row for %s: resizing the embeddings by one row (drawn from the mean and "
            "covariance of the others).",
            type(model).__name__,
            MASK_TOKEN,
        )
        with _transformers_quiet():  # its own note on mean resizing says what the line above says
            model.resize_token_embeddings(mask_id + 1)
    return mask_id


def to_mars(
    model: PreTrainedModel,
    tokenizer=None,
    block_size: int = 4,
    tau: float | None = None,
    confidence: str = "probability",
) -> PreTrainedModel:
    """Make `model` a MARS model, in place: MARS class, `<|mask|>` token, and MARS defaults in its configs.

    Args:
        model: a decoder-only causal LM (Qwen2/2.5/3, Llama, Mistral, ... any `*ForCausalLM` of transformers).
        tokenizer: its tokenizer; `<|mask|>` is added when missing. May be omitted if the model already has
            `config.mars_mask_token_id`.
        block_size: B, the most tokens one forward pass may emit (the paper trains B in {4, 8, 16}).
        tau: default τ written to the generation config, so that plain `generate()` decodes with MARS. Leave it
            `None` to keep `generate()` autoregressive unless `mars_tau` is passed.
        confidence: default confidence measure ("probability", "entropy" or "margin").

    Returns the same model object, now an instance of `MARS<Base>` (e.g. `MARSQwen2ForCausalLM`). Untrained, its
    masks predict nothing useful: fine-tune it with `MARSTrainer`, or load a MARS checkpoint. Saved, its config
    names the base class in `architectures` and `<|mask|>` as `mask_token_id` too, so vLLM serves it as the base
    model and drafts with it in parallel (docs/serving.md).
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    if tau is not None:
        check_tau(tau)
    if confidence not in CONFIDENCE_MEASURES:
        raise ValueError(f"confidence must be one of {CONFIDENCE_MEASURES}, got {confidence!r}")
    if not isinstance(model, PreTrainedModel) or model.config.is_encoder_decoder or not hasattr(model, "generate"):
        raise ValueError(f"to_mars needs a decoder-only transformers causal LM, got {type(model).__name__}.")

    if tokenizer is not None:
        mask_id = add_mask_token(model, tokenizer)
    elif getattr(model.config, "mars_mask_token_id", None) is not None:
        mask_id = model.config.mars_mask_token_id
    else:
        raise ValueError(f"Pass the tokenizer: to_mars adds the {MASK_TOKEN} token to it.")

    model.config.mars_block_size = block_size
    set_mask_token(model.config, mask_id)
    gen = model.generation_config
    gen.mars_block_size, gen.mars_confidence = block_size, confidence
    if tau is not None:
        gen.mars_tau = tau
    gen._from_model_config = False  # otherwise the mars_* keys are dropped when the checkpoint is reloaded
    _keep_rope_readable(model.config)
    model.__class__ = mars_class(type(model))
    return model


def _keep_rope_readable(config) -> None:
    """Write RoPE's base also as the top-level `rope_theta` (and a non-default scaling as `rope_scaling`) that
    transformers 4 reads: transformers 5 saves only `rope_parameters`, and 4.57 would silently fall back to a base of
    10000 (a Qwen2.5 base, 1e6, would then decode garbage). Transformers 5 reads the file with both keys alike."""
    rope = getattr(config, "rope_parameters", None)
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        return
    config.rope_theta = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default":
        config.rope_scaling = {key: value for key, value in rope.items() if key != "rope_theta"}


def convert_checkpoint(
    src: str | Path, dst: str | Path, block_size: int | None = None, tau: float | None = None
) -> Path:
    """Convert a MARS checkpoint published by the paper's authors into a self-contained hf_mars folder.

    The authors' checkpoints declare `model_type: a2d-qwen2` (code that transformers does not have) over standard
    Qwen2 weights, with `<|mask|>` in the tokenizer. The result declares `qwen2` plus an `auto_map` entry: it loads
    with `trust_remote_code=True` as MARS (hf_mars not needed) and without it as plain Qwen2.
    """
    src, dst = Path(src), Path(dst)
    raw = json.loads((src / "config.json").read_text())
    if raw.get("model_type") not in ("a2d-qwen2", "qwen2"):
        raise ValueError(f"{src} is not a MARS Qwen2 checkpoint (model_type {raw.get('model_type')!r}).")
    tokenizer = AutoTokenizer.from_pretrained(src)
    if MASK_TOKEN not in tokenizer.get_vocab():
        raise ValueError(f"The tokenizer in {src} has no {MASK_TOKEN} token: this is not a MARS checkpoint.")
    block_size = block_size or raw.get("mars_block_size") or raw.get("block_size") or 4
    for key in ("auto_map", "architectures", "model_type"):
        raw.pop(key, None)
    config = AutoConfig.for_model("qwen2", **raw)
    model = AutoModelForCausalLM.from_pretrained(src, config=config)
    to_mars(model, tokenizer, block_size=int(block_size), tau=tau)
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst)
    tokenizer.save_pretrained(dst)
    return dst


@contextlib.contextmanager
def _transformers_quiet():
    """transformers' logging at error level for the duration (its warnings restate what hf_mars says)."""
    previous = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(previous)
