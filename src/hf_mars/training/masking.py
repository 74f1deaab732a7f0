"""The two-stream attention layout MARS trains with.

One training sequence is `[clean | noisy]`. The clean stream is the example itself (length `l`, positions 0..l-1).
The noisy stream is a copy in which every labelled token is replaced by `<|mask|>`. With blocks counted from
position 0 (`block(p) = p // B`), attention is (the MARS paper, arXiv 2604.07023):

    clean -> clean : causal
    noisy -> noisy : same block, causal within it
    noisy -> clean : clean tokens of strictly earlier blocks only
    clean -> noisy : never

Placed as `[clean | noisy]` this is a subset of ordinary causal attention over the concatenated index space, so it is
expressed as an `and_mask_function` on top of transformers' causal mask, and `create_causal_mask` turns it into the
format of each attention implementation (bool for sdpa, additive float for eager, BlockMask for flex).

Cost: a noisy block without labelled tokens holds the real tokens and sees the same prefix as the clean stream, so
its outputs equal the clean ones. The noisy stream therefore only covers a tail: row `i` starts at `noisy_start[i]`,
the start of the block holding its first label, and its noisy token `j` sits at logical position
`noisy_start[i] + j`. The prompt, usually a large part of a chat example, is computed once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.masking_utils import create_causal_mask

from ..decoding.compat import CACHE_ARG

# Attention implementations that honour a custom mask. Flash attention kernels only take a 2D padding mask and would
# silently train with plain causal attention.
SUPPORTED_ATTENTION = ("eager", "sdpa", "flex_attention")


def two_stream_mask_function(clean_length: int, block_size: int, noisy_start: torch.Tensor) -> Callable:
    """The MARS pattern over index space `[clean (clean_length) | noisy tail]`, to be and-ed with causal attention.

    `noisy_start` (batch,) holds each row's first noisy logical position, a multiple of `block_size`. The function
    uses tensor ops only: transformers vmaps it (sdpa, eager) or compiles it (flex).
    """

    def mask_function(batch_idx, head_idx, q_idx, kv_idx):
        start = noisy_start[batch_idx]
        q_noisy, kv_noisy = q_idx >= clean_length, kv_idx >= clean_length
        # Logical positions: clean index i is position i, noisy index clean_length + j is position start + j
        q_block = torch.where(q_noisy, q_idx - clean_length + start, q_idx) // block_size
        kv_block = torch.where(kv_noisy, kv_idx - clean_length + start, kv_idx) // block_size
        # A clean query is left to the causal mask: it never reaches a noisy key, which comes later in index space.
        # Within the noisy stream index order is position order, so causal plus same-block is causal within the block.
        noisy_query = torch.where(kv_noisy, q_block == kv_block, kv_block < q_block)
        return ~q_noisy | noisy_query

    return mask_function


def two_stream_position_ids(clean_length: int, noisy_length: int, noisy_start: torch.Tensor) -> torch.Tensor:
    """Position ids `[0..l-1 | start..start+T-1]` per row. Entries past a row's end are padding; they are clamped to
    `l - 1` so that models with a position table never index past what the clean stream uses."""
    device = noisy_start.device
    clean = torch.arange(clean_length, device=device).expand(noisy_start.shape[0], -1)
    noisy = noisy_start[:, None] + torch.arange(noisy_length, device=device)
    return torch.cat([clean, noisy.clamp(max=clean_length - 1)], dim=1)


def create_two_stream_mask(
    config,
    clean_attention_mask: torch.Tensor,
    noisy_attention_mask: torch.Tensor,
    block_size: int,
    noisy_start: torch.Tensor,
    dtype: torch.dtype = torch.float32,
):
    """Model-ready attention mask for `[clean | noisy]`, in the format of `config._attn_implementation`.

    Args:
        config: the model config (its attention implementation picks the format).
        clean_attention_mask: (batch, l) padding mask of the clean stream, 1 for real tokens.
        noisy_attention_mask: (batch, T) padding mask of the noisy tail.
        block_size: B.
        noisy_start: (batch,) logical position of each row's first noisy token, a multiple of B.
        dtype: the model's compute dtype (eager adds the mask to the scores, so it must match).

    The explicit 2D mask matters: with repeated position ids and no 2D mask, transformers would take the batch for
    packed sequences.
    """
    impl = config._attn_implementation
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"MARS training needs an attention implementation that takes a custom mask, one of {SUPPORTED_ATTENTION}; "
            f"the model uses {impl!r}. Load it with attn_implementation='sdpa'."
        )
    batch, clean_length = clean_attention_mask.shape
    total = clean_length + noisy_attention_mask.shape[1]
    attention_mask = torch.cat([clean_attention_mask, noisy_attention_mask], dim=1).bool()
    # create_causal_mask reads only the shape, dtype and device of the embeddings
    shape_only = torch.empty(batch, total, 0, dtype=dtype, device=clean_attention_mask.device)
    position_ids = two_stream_position_ids(clean_length, noisy_attention_mask.shape[1], noisy_start)
    return create_causal_mask(
        config=config,
        inputs_embeds=shape_only,
        attention_mask=attention_mask,
        **{CACHE_ARG: None},  # no cache: the keyword's name depends on the transformers release
        position_ids=position_ids,
        and_mask_function=two_stream_mask_function(clean_length, block_size, noisy_start),
    )
