"""The KV cache of MARS decoding: transformers' own `StaticCache`, and the books MARS keeps over it.

Under causal attention the keys and values of a real token depend only on its prefix, so they are exact the moment
they are computed, whatever trails them. Each MARS pass writes `[pending | drafts | masks]` at the same slots for the
whole batch; the masks' slots are written again by the next pass, and a row that took fewer tokens, or rejected a
draft, leaves holes: slots that hold no token. `real` marks which slots hold tokens (the attention masks are made of
it), and position ids count real tokens only. `compact_static` squeezes the holes out when a pass would not fit.

A runner (`runner.py`) allocates one static cache for its rows (`allocate_stacked`: every layer a view of one
tensor); a rows' prompt's pass writes a view of it (`cache_view`, `StaticMARSCache`'s books over it), every later
pass the graph pass's own books (`graph.py`). `prefix_cache` gives `generate()`'s callers a `DynamicCache` back.

This file is copied into MARS checkpoints (trust_remote_code): it imports torch, transformers and `tree.py` only.
"""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache, StaticCache

from .compat import CACHE_ARG, counts_static_writes, rewind_static_layers, static_cache_size, static_init_shape
from .tree import NO_DRAFTS, DraftTree


class StaticMARSCache:
    """The books of a rows' prompt's pass (`session.Session.prompt_pass`) over transformers' own `StaticCache` (a
    runner's, or a view of its rows and slots): the pass writes its `[prompt | masks]` from `length` on (the static
    layers count them), then the layers step back over the masks, so the next pass overwrites them.

    Attributes:
        kv (`StaticCache`): what the model's forward reads and writes.
        real (`torch.BoolTensor` of shape `(batch, max_cache_len)`): which slots hold real tokens (or this pass's).
        next_position (`torch.LongTensor` of shape `(batch,)`): the position id of each row's next real token.
        length (`int`): slots committed so far.
    """

    def __init__(self, cache: StaticCache, batch_size: int, device: torch.device | str):
        self.kv = cache
        self.kept_as = None  # the key it is kept on the model by, where it outlives its run (`graph.captured`)
        self.size = static_cache_size(cache)
        self.real = torch.zeros(batch_size, self.size, dtype=torch.bool, device=device)
        self.counts_writes = counts_static_writes(cache)  # else each pass says where it writes (`compat`)
        self.next_position = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.length = 0

    def step_inputs(
        self, new_real: torch.BoolTensor, num_masks: int, tree: DraftTree = NO_DRAFTS
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot map as attention mask, and position ids (`pass_positions`), for a pass over `[new tokens
        (right-aligned) | drafts | masks]`: `len(tree) + 1` groups of `num_masks` masks (`DraftTree`)."""
        width = new_real.shape[1] + (len(tree) + 1) * num_masks
        if self.length + width > self.size:
            raise RuntimeError(f"MARS needs {self.length + width} static cache slots, the cache has {self.size}.")
        self.real[:, self.length : self.length + new_real.shape[1]] = new_real
        self.real[:, self.length + new_real.shape[1] : self.length + width].fill_(True)
        return self.real, pass_positions(self.next_position, new_real, num_masks, tree)

    def kv_length(self, width: int) -> int:
        return self.size

    def masks_per_group(self, schedule, offered: torch.Tensor, tau: float, whole_tree: bool = False) -> int:
        """All B-1 masks below τ = 1, whatever a row is offered (it uses only those), so that the shape stays; in
        lossless greedy mode at every τ (`whole_tree`), so that its drafts have the graph pass's tree, whose τ may
        cross 1 live (at τ >= 1 its masks propose nothing, and prompt lookup still drafts). Sampled, none at τ >= 1:
        no token is drawn for them, so that a seed draws plain sampling's tokens."""
        return schedule.most if tau < 1.0 or whole_tree else 0

    def key_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """`(batch, max_cache_len)`: the position id of every slot: committed, this pass's, then unwritten (unseen)."""
        rest = position_ids.new_zeros(position_ids.shape[0], self.size - self.length - position_ids.shape[1])
        return torch.cat([_slot_positions(self.real[:, : self.length]), position_ids, rest], dim=1)

    def forward_kwargs(self, width: int) -> dict:
        """The cache's keyword arguments of the model's forward: it, and where the pass writes (see `compat`)."""
        if self.counts_writes:
            return {CACHE_ARG: self.kv}
        slots = torch.arange(self.length, self.length + width, device=self.real.device)
        return {CACHE_ARG: self.kv, "cache_position": slots}

    def commit(self, new_real: torch.BoolTensor, num_masks: int) -> None:
        """After a pass: the layers step back over the masks, and the real tokens just cached are recorded."""
        if num_masks and self.counts_writes:  # else the next pass's `cache_position` overwrites them
            rewind_static_layers(self.kv, num_masks)
        self.real[:, self.length : self.length + new_real.shape[1]] = new_real
        self.length += new_real.shape[1]
        self.next_position = self.next_position + new_real.sum(dim=1)


def compact_static(
    kv, real: torch.Tensor, stacked: torch.Tensor | None = None, rows: slice = slice(None), end: int | None = None
) -> torch.Tensor:
    """Squeeze the holes out of a static cache in place: each row's real slots first, in order, the rest free (`real`
    marks them). `()` tensor: the slots now in use, where the next pass writes (the layers that count their writes
    are set there). Positions are untouched: rotary embeddings are already in the keys. With the default `rows` and
    `end`, the same fixed shapes every time, and no read of the device: a graph pass can run it between two replays.
    `rows`, `end`: the rows and the slots before `end` that hold anything real, all that is gathered (an eager pass's
    cache, far wider than what its rows hold, is not copied whole). `stacked`: one tensor that every layer's keys and
    values are views of, gathered at once."""
    whole = rows == slice(None) and end is None  # no view taken: a graph pass's fixed shapes, its fewest ops
    real_in_use = real if whole else real[rows, :end]
    order = torch.sort(real_in_use.to(torch.uint8), dim=1, descending=True, stable=True).indices  # real first
    count = real_in_use.sum(dim=1, keepdim=True)
    if stacked is not None:
        in_use = stacked if whole else stacked[:, rows, :, :end]
        in_use.copy_(_gather_slots(in_use, order))
    else:
        tensors = [t if whole else t[rows, :, :end] for layer in kv.layers for t in (layer.keys, layer.values)]
        torch._foreach_copy_(tensors, [_gather_slots(t, order) for t in tensors])
    torch.lt(torch.arange(real_in_use.shape[1], device=real.device), count, out=real_in_use)
    used = count.max()
    if counts_static_writes(kv):
        torch._foreach_copy_([layer.cumulative_length for layer in kv.layers], [used] * len(kv.layers))
    return used


def allocate_stacked(kv, model, rows: int) -> None:
    """Allocate a static cache's layers now (transformers allocates each at its first forward), every layer's keys and
    values views of one `(2 x layers, rows, heads, slots, dim)` tensor, so that a compaction gathers once, not once per
    layer (`stacked_layers` finds it). Left as it is where a layer is allocated already, where the layers differ in
    shape, or where transformers cannot allocate it early (layers on several devices). Each layer is allocated by
    transformers (`early_initialization`, one layer at a time), then its tensors replaced by the stack's views: at no
    time are more than the stack and one layer held."""
    shape = static_init_shape(model)
    if shape is None or not all(isinstance(n, int) for n in shape) or not counts_static_writes(kv):
        return
    if any(layer.is_initialized for layer in kv.layers) or len({layer.max_cache_len for layer in kv.layers}) != 1:
        return
    heads, head_dim = shape
    layers, size = kv.layers, static_cache_size(kv)
    stacked = torch.zeros(2 * len(layers), rows, heads, size, head_dim, dtype=model.dtype, device=model.device)
    with torch.enable_grad():  # views made under no_grad could not be written by a forward run with grad on
        views = [stacked[i] for i in range(len(stacked))]
    try:
        for layer, keys, values in zip(layers, views[0::2], views[1::2]):
            kv.layers = [layer]
            kv.early_initialization(rows, heads, head_dim, model.dtype, model.device)
            static = hasattr(layer.keys, "_dynamo_static_input_type")  # as transformers marks them for torch.compile
            layer.keys, layer.values = keys, values
            if static:
                torch._dynamo.mark_static_address(keys)
                torch._dynamo.mark_static_address(values)
    finally:
        kv.layers = layers
    kv.mars_stacked = stacked


def allocate_layers(kv, model, rows: int) -> None:
    """A static cache's layers allocated now: stacked (`allocate_stacked`), else each alone on the model's device (a
    release whose layers cannot be stacked here), where transformers would allocate them at the first forward; left
    to it where the model spans several devices. A runner's pass is built before its first forward."""
    allocate_stacked(kv, model, rows)
    if all(layer.is_initialized for layer in kv.layers) or len(set(getattr(model, "hf_device_map", {}).values())) > 1:
        return
    config = model.config.get_text_config()
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv.early_initialization(rows, heads, head_dim, model.dtype, model.device)


def stacked_layers(kv) -> torch.Tensor | None:
    """The one tensor whose views are every layer's keys and values, in order (`allocate_stacked`), else None."""
    stacked = getattr(kv, "mars_stacked", None)
    if stacked is None:
        return None
    tensors = [t for layer in kv.layers for t in (layer.keys, layer.values)]
    if len(tensors) != len(stacked) or any(t.data_ptr() != row.data_ptr() for t, row in zip(tensors, stacked)):
        return None  # the layers were given other tensors since
    return stacked


def cache_view(kv, slots: slice, rows: slice = slice(None), stacked: torch.Tensor | None = None):
    """A static cache `kv` seen through views: each layer's keys and values sliced to `rows` and `slots` (a forward's
    writes land in `kv`), each layer as long as its slots, sharing `kv`'s count of written slots. `stacked`: the one
    tensor the layers are views of (`stacked_layers`), sliced once for all of them."""
    if stacked is not None:
        tensors = stacked[:, rows, :, slots].unbind(0)
    else:
        tensors = [t[rows, :, slots] for layer in kv.layers for t in (layer.keys, layer.values)]
    return _cache_over(kv, tensors)


def gathered_cache(kv, reach: int, rows: torch.Tensor, stacked: torch.Tensor):
    """`(cache, gathered)`: a static cache of `kv`'s `rows` (indices, not necessarily adjacent) and first `reach`
    slots, copied out of `stacked` (`stacked_layers`) into `gathered`, sharing `kv`'s count of written slots. A
    forward's writes land in the copy: `put_back_rows` puts them back. Row by row, one strided copy each: an
    `index_select` over a view of the whole cache walks far more memory than it copies."""
    gathered = stacked.new_empty(stacked.shape[0], rows.numel(), stacked.shape[2], reach, stacked.shape[4])
    for place, row in enumerate(rows.tolist()):
        gathered[:, place].copy_(stacked[:, row, :, :reach])
    return _cache_over(kv, gathered.unbind(0)), gathered


def put_back_rows(stacked: torch.Tensor, rows: torch.Tensor, gathered: torch.Tensor) -> None:
    """`gathered_cache`'s copy of `rows`, with what a forward wrote into it, back into `stacked`."""
    for place, row in enumerate(rows.tolist()):
        stacked[:, row, :, : gathered.shape[3]].copy_(gathered[:, place])


def _cache_over(kv, tensors):
    """`kv` with each layer's keys and values replaced by `tensors` (keys, values, keys, ...), as long as they are."""
    view = copy.copy(kv)
    view.layers = [copy.copy(layer) for layer in kv.layers]
    for layer, keys, values in zip(view.layers, tensors[0::2], tensors[1::2]):
        layer.keys, layer.values, layer.max_cache_len = keys, values, keys.shape[2]
    return view


def prefix_cache(real: torch.Tensor, kv, tokens_at: torch.Tensor, limits: torch.Tensor) -> DynamicCache:
    """What `generate()` returns as its cache, from a runner's static cache `kv` whose slots `real` marks (`(batch,
    slots)`, from its first): a plain `DynamicCache` of the first `n` positions of the output sequences, with no
    holes, so that a later `generate()` (MARS or not) continues from it.

    `tokens_at` `(batch, width)`: which positions of the output hold tokens (not padding); row b's real slots are
    those tokens, in order. `n` is the least, over the rows, of how far a row's real slots reach and `limits[b]`
    (what the output keeps). Padding positions hold zeros: the attention mask hides them.
    """
    kv = [(layer.keys, layer.values) for layer in kv.layers]
    rank = tokens_at.long().cumsum(dim=1) - 1  # which real slot each position's token is
    reach = (rank < real.sum(dim=1, keepdim=True)).long().cumprod(dim=1).sum(dim=1)  # positions a row's slots cover
    length = int(torch.minimum(reach, limits).min())
    order = torch.sort(real.to(torch.uint8), dim=1, descending=True, stable=True).indices  # each row's real first
    slots = order.gather(1, rank[:, :length].clamp(min=0, max=real.shape[1] - 1))
    tensors = [t for pair in kv for t in pair]
    gathered = _gather_all(tensors, slots)
    valid = tokens_at[:, None, :length, None].to(gathered[0].dtype)  # padding positions: zeros
    torch._foreach_mul_(gathered, [valid] * len(gathered))
    out = DynamicCache()
    for layer in range(len(kv)):
        out.update(gathered[2 * layer], gathered[2 * layer + 1], layer)
    return out


def _slot_positions(real: torch.Tensor) -> torch.Tensor:
    """The position id of each cached slot: the real slots before it (positions count real tokens only)."""
    return real.long().cumsum(dim=1) - 1


def pass_positions(next_position, new_real, num_masks: int, tree: DraftTree):
    """Position ids of `[new tokens (right-aligned) | drafts | groups of masks]`, each row's first new token at
    `next_position`: pending tokens count real ones, each draft sits its depth past the last pending token, each
    group of masks continues the token it follows. The graph pass's table is this
    function's too (`graph._tables`)."""
    batch, width = new_real.shape
    pending = new_real[:, : width - len(tree)]
    pending_positions = next_position[:, None] + pending.long().cumsum(dim=1) - 1
    if not len(tree) and not num_masks:  # τ = 1's one-token pass: no more to place
        return pending_positions.clamp(min=0)
    root = pending_positions[:, -1:]
    drafts = [root + tree.on(root.device).depths[1:]] if len(tree) else []  # each its depth past the root
    anchors = torch.cat([root, *drafts], dim=1) if drafts else root  # (batch, groups): the token each group follows
    mask_positions = (anchors[:, :, None] + torch.arange(1, num_masks + 1, device=root.device)).reshape(batch, -1)
    return torch.cat([pending_positions, *drafts, mask_positions], dim=1).clamp(min=0)


def _gather_all(tensors: list, order: torch.LongTensor) -> list:
    """`_gather_slots` of each tensor, the index expanded once per shape (layers mostly share one): at the end of a
    run, over every layer, each op saved is one kernel launch saved per layer on a GPU."""
    index = order.view(order.shape[0], 1, order.shape[1], 1)
    expanded = {}
    for t in tensors:
        key = (t.shape[1], t.shape[3])
        if key not in expanded:
            expanded[key] = index.expand(t.shape[0], t.shape[1], order.shape[1], t.shape[3])
    return [t.gather(2, expanded[t.shape[1], t.shape[3]]) for t in tensors]


def _gather_slots(states: torch.Tensor, order: torch.LongTensor) -> torch.Tensor:
    """`states[..., b, :, order[b], :]` for a `(..., batch, heads, slots, dim)` tensor (layers stacked or not)."""
    lead = (1,) * (states.dim() - 4)
    index = order.view(*lead, order.shape[0], 1, order.shape[1], 1)
    return states.gather(-2, index.expand(*states.shape[:-2], order.shape[1], states.shape[-1]))
