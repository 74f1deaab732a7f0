"""Every transformers name MARS decoding relies on that is not stable public API, each behind one function.

A checkpoint's code runs under whatever transformers its user has, for years after it was published. So the other
decoding files use only stable public API plus what this file offers; each entry here takes the public route where
one exists, else the private one it names, else fails with an error that names the supported range. A release that
renames something is then one edit, here.

This file is copied into MARS checkpoints (trust_remote_code): it imports torch and transformers only.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re

import torch
import transformers
from transformers import DynamicCache, StaticCache
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.utils import logging

# The transformers releases this code is tested with (CI runs both ends); `hf_mars` records them in checkpoints.
TESTED_TRANSFORMERS = ("4.57.6", "5.24.0")

# The keyword under which a model's forward and `generate()` take the KV cache, and the output field that returns
# it: `cache` from transformers 5.24 (where `past_key_values` is a deprecated alias), `past_key_values` before.
CACHE_ARG = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


@functools.cache
def warn_if_untested() -> None:
    """Warn once, in one line, when this transformers release is outside the tested range (it may still work)."""
    low, high, now = (_minor(v) for v in (*TESTED_TRANSFORMERS, transformers.__version__))
    if not low <= now <= high:
        logging.get_logger(__name__).warning(
            f"MARS decoding was tested with transformers {TESTED_TRANSFORMERS[0]} to {TESTED_TRANSFORMERS[-1]}; "
            f"this is {transformers.__version__}."
        )


def _minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def unsupported(what: str) -> RuntimeError:
    """The error for a transformers release that lacks something MARS decoding needs."""
    low, high = TESTED_TRANSFORMERS[0], TESTED_TRANSFORMERS[-1]
    return RuntimeError(
        f"MARS decoding needs {what}, which transformers {transformers.__version__} lacks; "
        f"it is tested with transformers {low} to {high}."
    )


def forward_takes(model, *names: str) -> bool:
    """Whether `model.forward` takes every one of these keyword arguments by name."""
    return set(names) <= set(inspect.signature(model.forward).parameters)


def model_cache(model_kwargs: dict):
    """The cache `generate()` prepared for the decoding loop (or the user passed), if any."""
    return model_kwargs.get(CACHE_ARG)


def eos_token_ids(generation_config, device) -> torch.Tensor:
    """`(n,)` EOS ids of a prepared generation config (empty without any): public `eos_token_id`, int or list."""
    eos = generation_config.eos_token_id
    if eos is None:
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.as_tensor(eos, dtype=torch.long, device=device).view(-1)


def pad_token(generation_config, eos: torch.Tensor) -> int:
    """The id written after a row ends: `pad_token_id`, else the first EOS id (as `generate()` does), else 0."""
    pad = generation_config.pad_token_id
    if isinstance(pad, int):
        return pad
    if pad is not None:  # a list, or a tensor
        return int(torch.as_tensor(pad).view(-1)[0])
    return int(eos[0]) if eos.numel() else 0


def supports_logits_to_keep(model) -> bool:
    """Whether the forward can compute the logits of the last positions only (`logits_to_keep`)."""
    return forward_takes(model, "logits_to_keep")


def static_cache_size(cache) -> int:
    """The slots of a `StaticCache`."""
    for name in ("get_max_cache_shape", "get_max_length"):
        size = getattr(cache, name, None)
        if callable(size) and isinstance(size(), int):
            return size()
    raise unsupported("StaticCache.get_max_cache_shape()")


def mark_user_cache(generate_kwargs: dict) -> None:
    """Mark a cache the caller passed to `generate()` as theirs (transformers marks it, `_is_user_defined`, only in
    recent releases), so that MARS never replaces it with one of its own size."""
    for name in ("cache", "past_key_values"):
        cache = generate_kwargs.get(name)
        if cache is not None and not isinstance(cache, (tuple, list)):
            cache._mars_user_defined = True


def user_defined_cache(cache) -> bool:
    """Whether the user passed this cache (then MARS may not resize it) rather than `generate()` making it."""
    return bool(getattr(cache, "_mars_user_defined", False) or getattr(cache, "_is_user_defined", False))


def recurrent(model) -> bool:
    """Whether some layers keep a recurrent state (which cannot drop masks): the cache's own flags where the release
    has them, else the model class's `_is_stateful`."""
    probe = DynamicCache(config=model.config)
    flags = list(getattr(probe, "is_linear", [])) + list(getattr(probe, "is_dummy", []))
    return bool(getattr(model, "_is_stateful", False) or any(flags))


def new_static_cache(model, generation_config, batch_size: int, size: int, model_kwargs: dict, full_layers=False):
    """A static cache of `size` slots. Where generate()'s own helper makes a fresh cache and remembers the size (so
    later calls are not recompiled), through it. Earlier releases keep the cache in `model._cache` and read its batch
    size from its data, which a cache never written lacks: ours goes there. `full_layers`: every layer keeps every
    slot, sliding-window ones too (their windows are then in the masks)."""
    prepare = getattr(model, "_prepare_static_cache", None)
    if full_layers:
        cache = StaticCache(config=full_attention_config(model.config), max_cache_len=size)
    elif prepare is not None and "prefill_chunk_size" in inspect.signature(prepare).parameters:
        cache = prepare(generation_config.cache_implementation, batch_size, size, None, model_kwargs)
    else:
        cache = model._cache = StaticCache(config=model.config, max_cache_len=size)
    model_kwargs[CACHE_ARG] = cache
    return cache


def static_init_shape(model):
    """`(kv heads, head dim)` to allocate a static cache's layers before its first forward (each an int, or a list by
    layer), or None where transformers cannot (layers on several devices) or has no such helper (before 5.x)."""
    shape = getattr(model, "_get_static_cache_init_shape", None)
    return shape() if shape is not None else None


def full_attention_config(config):
    """A copy of a model's (text) config whose every layer is full attention, for a cache that keeps every slot."""
    config = copy.deepcopy(config.get_text_config(decoder=True))
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    config.sliding_window = None
    return config


def compiles(model, generation_config, model_kwargs: dict) -> bool:
    """Whether `generate()` would compile its forward for these kwargs (its own criteria)."""
    criteria = getattr(model, "_valid_auto_compile_criteria", None)
    return criteria is not None and bool(criteria(model_kwargs, generation_config))


# Shapes one compiled forward may take in a process: one per pass width and batch size that MARS runs (τ-mode, each
# lossless tree, the trees `"auto"` times). Past torch's default of 8 the rest would run eagerly, silently slower.
RECOMPILE_LIMIT = 64


def many_shapes(compiled):
    """`compiled` (a `torch.compile`d function) allowed `RECOMPILE_LIMIT` shapes in its calls from here."""

    def call(*args, **kwargs):  # torch reads the limit when a call misses every shape compiled so far
        with torch._dynamo.config.patch(recompile_limit=max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)):
            return compiled(*args, **kwargs)

    return call


def counts_static_writes(cache) -> bool:
    """Whether a `StaticCache`'s layers place each write after the last (`cumulative_length`, from 5.4), or where
    the forward's `cache_position` says (before)."""
    return all(hasattr(layer, "cumulative_length") for layer in cache.layers)


def rewind_static_layers(cache, slots: int) -> None:
    """Step every layer of a `StaticCache` that counts its writes back `slots` slots, so the next write overwrites
    them."""
    torch._foreach_sub_([layer.cumulative_length for layer in cache.layers], slots)


def build_attention_mask(
    model, batch_size: int, q_length: int, kv_length: int, q_offset: int, mask_function, **kwargs
):
    """The 4D mask of `model`'s attention implementation from `transformers.masking_utils`' own builder, whose
    queries were given as `cache_position` before 5.4 and as `q_length`/`q_offset` since."""
    build = ALL_MASK_ATTENTION_FUNCTIONS[model.config._attn_implementation]
    if _takes_q_length(build):
        span = dict(q_length=q_length, q_offset=q_offset)
    else:
        span = dict(cache_position=torch.arange(q_offset, q_offset + q_length, device=kwargs.get("device")))
    return build(batch_size=batch_size, kv_length=kv_length, mask_function=mask_function, **span, **kwargs)


@functools.cache
def _takes_q_length(build) -> bool:  # read once per builder: a signature costs more than the rest of a mask's set-up
    return "q_length" in inspect.signature(build).parameters


def with_cache(output_cls, cache, **fields):
    """`output_cls(**fields)` with the cache under this release's field name."""
    return output_cls(**fields, **{CACHE_ARG: cache})
