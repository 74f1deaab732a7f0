"""The KV cache of MARS decoding: a `DynamicCache` that keeps real tokens only.

Under causal attention the keys and values of a real token depend only on its prefix, so they are exact the moment
they are computed, whatever trails them. Each MARS pass feeds [tokens accepted last pass | B-1 masks]; afterwards the
masks' K/V are cropped off and the real tokens' K/V stay. Nothing committed is ever recomputed or copied.

Rows of a batch accept different numbers of tokens per pass. The new tokens of a pass are right-aligned (exactly as
a left-padded prompt is), so a row that accepted fewer leaves holes: cache slots that hold no token. `real` marks
which slots hold tokens; it becomes the 2D attention mask, and position ids count real tokens only. `compact()`
squeezes the holes out when they grow to a large share of the cache.

With `generate(..., cache_implementation="static")` (and so `torch.compile`), transformers' own `StaticCache` holds
the K/V instead and `StaticMARSCache` keeps the same books over it: every pass has the same width, writes at the
same offset for the whole batch, and the masks' slots are overwritten by the next pass instead of cropped.

This file is copied into MARS checkpoints (trust_remote_code): it imports torch, transformers and `tree.py` only.
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch
from transformers import DynamicCache, StaticCache

from .compat import CACHE_ARG, counts_static_writes, rewind_static_layers, static_cache_size, static_init_shape
from .tree import NO_DRAFTS, DraftTree


class KVBook(Protocol):
    """What the decoding loop asks of a MARS cache; `MARSCache` (dynamic) and `StaticMARSCache` (fixed shapes) both
    answer, so that the loop never asks which one it has.

    Attributes:
        fixed_shapes: every pass has the same shape (a static cache: drafts trees keep their whole shape).
        real, next_position, length: see `MARSCache`.
    """

    fixed_shapes: bool
    real: torch.Tensor
    next_position: torch.Tensor

    @property
    def length(self) -> int: ...
    def masks_per_group(self, schedule, offered: torch.Tensor, tau: float, whole_tree: bool = False) -> int: ...
    def wide_mask(self, width: int) -> bool: ...
    def step_inputs(self, new_real, num_masks: int, tree: DraftTree = NO_DRAFTS, dense=None): ...
    def forward_kwargs(self, width: int) -> dict: ...
    def kv_length(self, width: int) -> int: ...
    def key_positions(self, position_ids: torch.Tensor) -> torch.Tensor: ...
    def commit(self, new_real, num_masks: int, dense: bool | None = None) -> None: ...
    def pending_width(self, width: int, accepted: torch.Tensor) -> tuple[int, bool]: ...
    def retire(self, stopped: torch.Tensor) -> tuple[torch.Tensor | None, bool]: ...
    def tidy(self, passes: int, every: int, at: float) -> None: ...
    def real_slots(self, batch_size: int): ...


class MARSCache(DynamicCache):
    """A `DynamicCache` plus the per-row bookkeeping of MARS decoding.

    Rows leave the batch as they finish (`keep_rows`), and passes are as wide as their content: shapes change.

    Attributes:
        real (`torch.BoolTensor` of shape `(batch, cached_len)`): which cache slots hold real tokens (a real slot's
            position id is the count of real slots before it).
        next_position (`torch.LongTensor` of shape `(batch,)`): the position id of each row's next real token.
    """

    fixed_shapes = False

    def __init__(self, batch_size: int, device: torch.device | str, keep_retired: bool = False):
        super().__init__()  # no config: every layer a full `DynamicLayer`, whose `crop` drops the trailing masks
        self.real = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)
        self.next_position = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.dense = True  # no slot is a hole
        self.rows = torch.arange(batch_size, device=device)  # the batch rows this cache still holds
        self.keep_retired = keep_retired  # whether rows that leave keep their K/V, for `to_prefix_cache`
        self.retired: list[tuple[torch.Tensor, torch.Tensor, list]] = []  # (batch rows, real, [(keys, values)])

    @classmethod
    def from_prefix(cls, cache, attention_mask: torch.Tensor, keep_retired: bool = False) -> MARSCache:
        """A MARS cache holding what `cache` (a `Cache` of the first `n` tokens of every row, as `generate()` returns
        it) holds: the slots that `attention_mask[:, :n]` marks are real tokens, positions count them."""
        length = cache.get_seq_length()
        new = cls(attention_mask.shape[0], attention_mask.device, keep_retired)
        for index, layer in enumerate(cache.layers):
            new.update(layer.keys[:, :, :length], layer.values[:, :, :length], index)
        new.commit(attention_mask[:, :length].bool(), 0)
        return new

    def step_inputs(
        self, new_real: torch.BoolTensor, num_masks: int, tree: DraftTree = NO_DRAFTS, dense: bool | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """2D attention mask and position ids for a pass over `[new tokens (right-aligned) | masks]`; `dense`: whether
        `new_real` is all True, if the caller knows (else it is read from the device).

        Lossless mode: the last `len(tree)` new tokens are drafts forming a tree (`DraftTree`), each one position
        past the token it follows. The masks then come as `len(tree) + 1` groups of `num_masks`: group 0 follows the
        root, group i + 1 draft i, and each group's positions continue from the token it follows. Which tokens see
        which is `DraftTree.visibility`'s business.
        Returns `None` for the mask when no slot is a hole, so the model takes its fastest (mask-free causal) path,
        as `generate()` does for unpadded batches.
        """
        position_ids = pass_positions(self.next_position, new_real, num_masks, tree)
        if self.dense and (dense if dense is not None else bool(new_real.all())):
            return None, position_ids
        masks = torch.ones(new_real.shape[0], (len(tree) + 1) * num_masks, dtype=torch.bool, device=new_real.device)
        return torch.cat([self.real, new_real, masks], dim=1).long(), position_ids

    def masks_per_group(self, schedule, offered: torch.Tensor, tau: float, whole_tree: bool = False) -> int:
        """Masks per group this pass: none at τ >= 1 (no mask proposes there); else the largest a row is offered (or
        more, where a wider pass is cheaper: `MaskSchedule.width`)."""
        if tau >= 1.0:
            return 0
        return schedule.most if schedule.constant else schedule.width(offered)

    def wide_mask(self, width: int) -> bool:
        """Whether a pass of `width` tokens takes a 4D mask built by MARS, once, rather than by every layer."""
        return width > 1

    @property
    def kv(self) -> MARSCache:
        """What the model's forward reads and writes: this cache itself."""
        return self

    def forward_kwargs(self, width: int) -> dict:
        """The cache's keyword arguments of the model's forward, for a pass of `width` tokens."""
        return {CACHE_ARG: self}

    @property
    def length(self) -> int:
        """Cache slots before this pass's."""
        return self.get_seq_length()

    def kv_length(self, width: int) -> int:
        """Keys a pass of `width` tokens attends over."""
        return self.length + width

    def key_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """`(batch, kv_length)`: the position id of every key a pass fed at `position_ids` attends over (a hole's is
        that of the real slot before it: the attention mask hides it anyway)."""
        return torch.cat([_slot_positions(self.real), position_ids], dim=1)

    def commit(self, new_real: torch.BoolTensor, num_masks: int, dense: bool | None = None) -> None:
        """After a pass: drop the K/V of the trailing masks and record the real tokens just cached (`dense`: see
        `step_inputs`)."""
        if num_masks:
            self.crop(-num_masks)
        self.real = torch.cat([self.real, new_real], dim=1)
        self.dense = self.dense and (dense if dense is not None else bool(new_real.all()))
        self.next_position = self.next_position + new_real.sum(dim=1)

    def pending_width(self, width: int, accepted: torch.Tensor) -> tuple[int, bool]:
        """`(width, dense)` of the next pass's pending tokens (`accepted` per row, at most `width`): as wide as the
        most any row took, and dense when every row took as many (one read from the device)."""
        most, fewest = torch.stack([accepted.max(), accepted.min()]).tolist()
        return most, fewest == most

    def retire(self, stopped: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
        """Drop the rows that `stopped`: `(the indices of the rows kept, or None when none left, whether any is)`."""
        if not bool(stopped.any()):
            return None, True
        alive = (~stopped).nonzero().view(-1)
        self.keep_rows(alive)
        return alive, bool(alive.numel())

    def tidy(self, passes: int, every: int, at: float) -> None:
        """Every `every` passes, squeeze out holes once they are more than `at` of a batched cache."""
        if passes % every == 0 and self.real.shape[0] > 1 and self.hole_fraction() > at:
            self.compact()

    def keep_rows(self, rows: torch.LongTensor) -> None:
        """Drop finished rows, so that they stop costing compute (their K/V are set aside if `keep_retired`)."""
        if self.keep_retired:
            gone = torch.ones_like(self.rows, dtype=torch.bool).index_fill_(0, rows, False).nonzero().view(-1)
            kv = [(layer.keys[gone], layer.values[gone]) for layer in self.layers]
            self.retired.append((self.rows[gone], self.real[gone], kv))
        self.batch_select_indices(rows)
        self.real = self.real[rows]
        self.next_position = self.next_position[rows]
        self.rows = self.rows[rows]

    def real_slots(self, batch_size: int):
        """`(real, [(keys, values) per layer])` over the whole batch, retired rows included, in batch order."""
        parts = [(self.rows, self.real, [(layer.keys, layer.values) for layer in self.layers])] + self.retired
        width = max(real.shape[1] for _, real, _ in parts)
        real = self.real.new_zeros(batch_size, width)
        for rows, part_real, _ in parts:
            real[rows, : part_real.shape[1]] = part_real

        def whole(layer: int, which: int) -> torch.Tensor:
            like = parts[0][2][layer][which]
            full = like.new_zeros(batch_size, like.shape[1], width, like.shape[3])
            for rows, _, kv in parts:
                full[rows, :, : kv[layer][which].shape[2]] = kv[layer][which]
            return full

        return real, [(whole(layer, 0), whole(layer, 1)) for layer in range(len(self.layers))]

    def hole_fraction(self) -> float:
        return 0.0 if self.real.numel() == 0 else 1.0 - self.real.float().mean().item()

    def compact(self) -> None:
        """Squeeze out holes: right-align each row's real slots, as left padding does.

        Attention over a hole is wasted work; compaction costs one gather of the cache, so callers run it only when
        holes are a large share of it. Positions are untouched: rotary embeddings are already in the keys.
        """
        length = int(self.real.sum(dim=1).max())
        # Stable sort on the 0/1 mask puts holes first and keeps the real slots in order; keep the last `length`.
        order = torch.sort(self.real.to(torch.uint8), dim=1, stable=True).indices[:, -length:]
        for layer in self.layers:
            if layer.get_seq_length() == 0:
                continue
            layer.keys = _gather_slots(layer.keys, order)
            layer.values = _gather_slots(layer.values, order)
        self.real = self.real.gather(1, order)
        self.dense = bool(self.real.all())


class StaticMARSCache:
    """The bookkeeping of `MARSCache` over transformers' own `StaticCache`, for fixed shapes (`torch.compile`).

    Every pass writes its `[pending | drafts | masks]` at the same slots for the whole batch, from `length` on (the
    static layers count them). After the pass the layers step back over the masks, so the next pass overwrites them:
    nothing is cropped, nothing is reallocated. A row that takes fewer tokens than the pass's pending width, and the
    drafts it rejects, leave holes; once a pass would not fit, `compact_static` squeezes them out in place. So the
    cache needs room for the text and a few passes (`static_cache_length`), not for every slot a pass writes: every
    pass attends over the whole `(batch, max_cache_len)` slot map, so its size is what attention costs. Rows stay in
    the batch until all have finished, as in `generate()`, so that shapes never change.

    Attributes:
        kv (`StaticCache`): what the model's forward reads and writes.
        stacked (`torch.Tensor` or None): the one tensor its layers' K/V are views of, if so (`allocate_stacked`).
        real (`torch.BoolTensor` of shape `(batch, max_cache_len)`): which slots hold real tokens (or this pass's).
        next_position (`torch.LongTensor` of shape `(batch,)`): the position id of each row's next real token.
        length (`int`): slots committed so far.
    """

    fixed_shapes = True

    def __init__(self, cache: StaticCache, batch_size: int, device: torch.device | str):
        self.kv, self.stacked = cache, stacked_layers(cache)
        self.kept_as = None  # the key it is kept on the model by, where it outlives its run (`graph.captured`)
        self.size = static_cache_size(cache)
        self.real = torch.zeros(batch_size, self.size, dtype=torch.bool, device=device)
        self.counts_writes = counts_static_writes(cache)  # else each pass says where it writes (`compat`)
        self.next_position = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.length = 0

    def step_inputs(
        self, new_real: torch.BoolTensor, num_masks: int, tree: DraftTree = NO_DRAFTS, dense: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot map as attention mask, and position ids, for a pass (see `MARSCache.step_inputs`)."""
        width = new_real.shape[1] + (len(tree) + 1) * num_masks
        if self.length + width > self.size:
            self.real[:, self.length :].fill_(False)  # the last pass's masks
            self.length = int(compact_static(self.kv, self.real, self.stacked, end=self.length))
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

    def wide_mask(self, width: int) -> bool:
        """Never: a static pass builds its mask inside the compiled graph (except for a tree or a window)."""
        return False

    def pending_width(self, width: int, accepted: torch.Tensor) -> tuple[int, bool]:
        """Always `width` pending slots, the unfilled ones holes: the shape stays and nothing is read."""
        return width, False

    def retire(self, stopped: torch.Tensor) -> tuple[None, bool]:
        """Rows that stopped stay in the batch, idle, as in `generate()`: `(None, whether any row still decodes)`."""
        return None, bool((~stopped).any())

    def tidy(self, passes: int, every: int, at: float) -> None:
        """Nothing: the cache compacts when a pass would not fit (`step_inputs`), keeping its shapes."""

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

    def real_slots(self, batch_size: int):
        """`(real, [(keys, values) per layer])`: the committed slots (see `MARSCache.real_slots`)."""
        return self.real[:, : self.length], [(layer.keys, layer.values) for layer in self.kv.layers]

    def commit(self, new_real: torch.BoolTensor, num_masks: int, dense: bool | None = None) -> None:
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


def prefix_cache(cache, tokens_at: torch.Tensor, limits: torch.Tensor) -> DynamicCache:
    """What `generate()` returns as its cache, from a MARS cache: a plain `DynamicCache` of the first `n` positions of
    the output sequences, with no holes, so that a later `generate()` (MARS or not) continues from it.

    `tokens_at` `(batch, width)`: which positions of the output hold tokens (not padding); row b's real slots are
    those tokens, in order. `n` is the least, over the rows, of how far a row's real slots reach and `limits[b]`
    (what the output keeps). Padding positions hold zeros: the attention mask hides them.
    """
    real, kv = cache.real_slots(tokens_at.shape[0])
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
    group of masks continues the token it follows (see `MARSCache.step_inputs`). The graph pass's table is this
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
