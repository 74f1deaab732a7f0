"""Calibration: what masks add to the time of a pass on this machine (`mars_mask_cost`), measured, and resolved for a
call (`mars_mask_cost="auto"`)."""

from __future__ import annotations

import statistics
import time

import torch
from transformers import DynamicCache

from ..decoding.compat import CACHE_ARG
from ..decoding.generate import mars_settings
from .decode import sync


def auto_mask_cost(model, batch_size: int = 1, measured: list[float] | None = None, **mars_kwargs) -> list[float]:
    """`mars_mask_cost="auto"` resolved for a call with these `mars_*` kwargs: the cost of 1 .. B-1 masks measured
    on this machine (`measured`, else `measure_mask_cost` now) for the model's own B, cut to the B this call runs
    with, which may be smaller."""
    costs = measured if measured is not None else measure_mask_cost(model, batch_size)
    kwargs = {key: value for key, value in mars_kwargs.items() if key != "mars_mask_cost"}
    return costs[: mars_settings(model, None, batch_size, **kwargs)["mars_block_size"] - 1]


def measure_mask_cost(model, batch_size: int = 1, context: int = 256, repeats: int = 7) -> list[float]:
    """What masks add to the time of a decoding pass on this model and machine: `mars_mask_cost` as a list.

    Times forwards over 1 to B tokens (B = the model's block size) after `context` cached tokens, `repeats` times each
    in alternation, and returns, for k = 1 .. B-1 masks, `median(t_{k+1}) / median(t_1) - 1`. Measured, not assumed:
    the cost depends on the dtype's matrix kernels (a pass over a few rows may cost as much as over eight, or a pass
    over 2 tokens more than over 4) and so differs between machines.

    At batch > 1 the passes carry an attention mask with holes, as batched decoding's do (left-padded prompts, rows
    that accepted fewer tokens): attention without a mask takes another path at another speed, so timing it would
    misjudge what decoding pays.
    """

    block = int(model.config.mars_block_size)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (batch_size, context + block), device=model.device)
    real = torch.ones_like(ids)
    real[1::2, : max(1, context // 8)] = 0  # every other row left-padded, as in a batch of unequal prompts

    def mask(end: int):
        return real[:, :end] if batch_size > 1 else None

    cache = DynamicCache(config=model.config)
    times = {width: [] for width in range(1, block + 1)}
    with torch.no_grad():
        model(input_ids=ids[:, :context], attention_mask=mask(context), **{CACHE_ARG: cache}, use_cache=True)
        for _ in range(repeats + 1):  # the first round warms up
            for width in times:
                sync(model)
                start = time.perf_counter()
                model(
                    input_ids=ids[:, context : context + width],
                    attention_mask=mask(context + width),
                    **{CACHE_ARG: cache},
                    use_cache=True,
                    logits_to_keep=width,
                )
                sync(model)
                times[width].append(time.perf_counter() - start)
                cache.crop(-width)
    one = statistics.median(times[1][1:])
    return [round(max(0.0, statistics.median(times[w][1:]) / one - 1), 3) for w in range(2, block + 1)]
