"""Attention that adds key by key, in key order: a query's output does not depend on the shape of the pass.

Lossless mode promises greedy `generate()`'s tokens. It verifies drafts in one forward over several tokens, and a
token's logits are only the same as a one-token step's where every operator computes a row the same way whatever
else its tensor holds. The linear layers are `ordered_linear.py`'s (in bfloat16 on CPUs a row is bitwise the same
at 1 and at many rows already; in float32 it is where products take blocks of one shape). `sdpa` does not: its
kernel splits the keys into blocks and rescales partial sums between them, so a query's result changes with the
number of queries beside it and with masked keys its tensor holds beyond its own (a pass's later tokens, a static
cache's empty slots, a batch's padding). docs/decoding.md ("Exact bits") has the findings.

`ordered` computes each query alone, in float32: scores as products summed over the head dimension (a fixed length),
the softmax's maximum (exact in any order), then the exponentials and the weighted values added by a running sum
over the keys in their order (`cumsum`, sequential on CPUs). A masked key adds an exact zero wherever it sits, so a
query over its context gives the same bits in a one-token step, in a wide pass, beside a tree's other branches, in a
padded batch or over a static cache. Select it as any attention: `from_pretrained(..., attn_implementation="ordered")`
or `model.set_attn_implementation("ordered")`; plain `generate()` then runs it too, so lossless mode is compared with
the same model. Importing this module registers it (the MARS classes do, in `modeling.py`).

This file is copied into MARS checkpoints (trust_remote_code).
"""

from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "ordered"
QUERY_CHUNK = 16  # queries computed at once: a prompt holds (chunk, keys, head_dim) per head at a time, not (q, ...)


def ordered_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """`(output, None)`: attention over `query` `(batch, heads, q, dim)` and `key`, `value` `(batch, kv_heads, k,
    dim)` with `attention_mask` `(batch, 1, q, k)` (bool: True sees; or additive), as `eager_attention_forward`
    returns it, `(batch, q, heads, dim)`, each query's sums taken key by key in key order. The heads that share a
    K/V head are taken as more queries of it (K/V are not copied per head)."""
    batch, heads, length, dim = query.shape
    groups = heads // key.shape[1]
    scaling = dim**-0.5 if scaling is None else scaling
    queries = (query.float() * scaling).reshape(batch, key.shape[1], groups * length, dim)
    keys, values = key.float(), value.float()
    if attention_mask is not None:
        attention_mask = attention_mask[..., : keys.shape[2]].repeat(1, 1, groups, 1)  # per (group, query)
    chunks = []
    for start in range(0, queries.shape[2], QUERY_CHUNK):
        stop = start + QUERY_CHUNK
        mask = None if attention_mask is None else attention_mask[:, :, start:stop]
        chunks.append(_attend(queries[:, :, start:stop], keys, values, mask))
    out = torch.cat(chunks, dim=2).view(batch, heads, length, dim)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _attend(queries, keys, values, mask):
    """`(batch, heads, q, dim)`: softmax-weighted values of `q` queries, in float32. A masked score becomes float32's
    least value, whose exponential after the maximum is subtracted is exactly 0 (a row with no key seen averages its
    values, as eager attention's additive mask does, rather than making NaNs that a later 0 times would spread)."""
    scores = (queries.unsqueeze(-2) * keys.unsqueeze(-3)).sum(dim=-1)  # (batch, heads, q, k): over the head dimension
    if mask is not None:
        least = torch.finfo(torch.float32).min
        scores = scores.masked_fill(~mask, least) if mask.dtype == torch.bool else (scores + mask).clamp(min=least)
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    total = weights.cumsum(dim=-1)[..., -1:]
    weighted = (weights.unsqueeze(-1) * values.unsqueeze(-3)).cumsum(dim=-2)[..., -1, :]
    return weighted / total


@functools.wraps(sdpa_mask)
def ordered_mask(*args, **kwargs):
    """`sdpa_mask`'s boolean mask, always built: without one (transformers skips it for a causal batch with no
    padding) a query would see the keys after it."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(NAME, ordered_attention)
AttentionMaskInterface.register(NAME, ordered_mask)
