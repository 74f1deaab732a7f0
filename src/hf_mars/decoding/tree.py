"""Lossless mode's drafts as a tree: its shape, who sees whom in a pass, and prompt lookup's branch.

A pass of lossless mode feeds `[pending | drafts | groups of masks]`. The drafts form a tree shared by the rows:
draft i follows draft `parents[i] < i`, or the last pending token (the root) when `parents[i] == -1`. One group of
masks follows the root and one follows each draft, so whatever a pass keeps, the group after its last kept draft
has seen exactly the text as it now stands. Most passes repeat the shape of earlier ones, so a `DraftTree` and
everything derived from it are built once per shape and shared: read them, never write into them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .compat import build_attention_mask

# Prompt lookup (`mars_lookup`): the longest n-gram it matches
LOOKUP_NGRAM = 3
# Tree shapes kept built: chain lengths x the depths with runner-ups fed x lookup's reach
SHAPES = 1024
# Prompt lookup's column tables kept built (`lookup_columns`): few, since each is as wide as a text buffer
LOOKUP_SHAPES = 32


@dataclass(frozen=True)
class DraftTree:
    """The shape of a pass's drafts: `parents[i]` is the draft that draft i follows (-1: the root).

    `from_masks` drafts come first, proposed by the last pass's masks; the rest came from prompt lookup (a pass
    credits its masks only for drafts they proposed).
    """

    parents: tuple[int, ...] = ()
    from_masks: int = 0

    @staticmethod
    def of(parents: tuple[int, ...], from_masks: int | None = None) -> DraftTree:
        """The tree of these parents, whose first `from_masks` drafts (default: all) the masks proposed. Trees are
        values (equal parents, equal trees), and their tensors are made once per shape (`on`), so a compiled pass
        that proposes one traces a plain constructor, no cache."""
        return DraftTree(parents, len(parents) if from_masks is None else from_masks)

    def __len__(self) -> int:
        return len(self.parents)

    # Plain properties over caches keyed by `parents` (not `cached_property`, whose lock torch.compile cannot trace)
    @property
    def lineage(self) -> torch.BoolTensor:
        """`(len + 1, len)`: row 0 is the root (no draft); row i + 1 marks draft i and its ancestors."""
        return _lineage(self.parents)

    @property
    def depths(self) -> torch.LongTensor:
        """How many positions past the root each draft sits: the length of its path."""
        return _depths(self.parents)

    @property
    def path_lengths(self) -> tuple[int, ...]:
        """`depths` as Python ints, from `parents` alone (no tensor is read)."""
        return _path_lengths(self.parents)

    @property
    def depth(self) -> int:
        """How many positions past the root the deepest draft sits, as a Python int."""
        return max(self.path_lengths, default=0)

    def on(self, device) -> TreeTensors:
        """The tree's tensors on `device`, made there once per tree (see `TreeTensors`)."""
        return _on_device(self, str(device))

    def scored_lineage(self, num_masks: int, device) -> torch.BoolTensor:
        """`lineage` for each slot a lossless pass scores, `[root, drafts, groups of masks]`: a mask's is the node's
        whose group it is in (the drafts on the path the masks continue), made on `device` once per tree and width."""
        return _scored_lineage(self, num_masks, str(device))

    def visibility(self, num_pending: int, num_masks: int) -> torch.BoolTensor:
        """Which tokens of a pass see which, among `[pending | drafts | groups of masks]`: `(queries, queries)`.

        A draft sees the pending tokens, its ancestors and itself; group 0 sees the pending tokens, group i + 1 those
        and draft i's lineage; a mask sees the masks of its own group before it. So every draft and every group
        computes what a plain causal pass over the text it continues would compute. Everything cached is visible.
        """
        return _visibility(self, num_pending, num_masks)


NO_DRAFTS = DraftTree()  # a pass without drafts (τ-mode, or lossless mode's first pass)


def _counts(candidates) -> tuple[int, ...]:
    """`mars_draft_candidates` as counts per depth from depth 1: an int N is `(N,)`."""
    return (candidates,) if isinstance(candidates, int) else tuple(candidates)


def depth_candidates(candidates, depths: int) -> tuple[int, ...]:
    """`mars_draft_candidates` as drafts at each of the depths 1 .. `depths`: an int N is N at depth 1 and one (the
    chain) below it; a list gives depth d's count at index d - 1, and one past its end."""
    return (_counts(candidates) + (1,) * depths)[:depths]


def runner_ups(candidates) -> int:
    """How many drafts `mars_draft_candidates` adds to the chain: the runner-ups of every depth."""
    return sum(count - 1 for count in _counts(candidates))


def full_tree(masks: int, candidates, lookup: int) -> DraftTree:
    """The whole tree that every lossless pass proposes (`verify.propose`, then `lookup`'s branch): the chain of
    `masks` drafts, the runner-ups of each depth after the chain's draft above it, then prompt lookup's branch of
    `lookup` drafts from the root."""
    parents = tuple(range(-1, masks - 1))
    for depth, count in enumerate(depth_candidates(candidates, masks), start=1):
        parents += (depth - 2,) * (count - 1)
    from_masks = len(parents)
    if lookup:
        parents += (-1,) + tuple(range(from_masks, from_masks + lookup - 1))
    return DraftTree.of(parents, from_masks)


def canonical_candidates(candidates) -> int | tuple[int, ...]:
    """One spelling per tree: trailing ones dropped (the chain is there anyway), an int where only depth 1 has
    runner-ups, so `[3, 1, 1]`, `[3]` and `3` are all `3`."""
    counts = list(_counts(candidates))
    while len(counts) > 1 and counts[-1] == 1:
        counts.pop()
    return counts[0] if len(counts) == 1 else tuple(counts)


@functools.lru_cache(maxsize=SHAPES)
def _lineage(parents: tuple[int, ...]) -> torch.BoolTensor:
    lineage = torch.eye(len(parents) + 1, dtype=torch.bool)[:, 1:]
    for i, parent in enumerate(parents):
        if parent >= 0:
            lineage[i + 1] |= lineage[parent + 1]
    return lineage


@functools.lru_cache(maxsize=SHAPES)
def _depths(parents: tuple[int, ...]) -> torch.LongTensor:
    return torch.tensor(_path_lengths(parents), dtype=torch.long)


@functools.lru_cache(maxsize=SHAPES)
def _path_lengths(parents: tuple[int, ...]) -> tuple[int, ...]:
    lengths: list[int] = []
    for parent in parents:  # a draft sits one past its parent (-1: the root)
        lengths.append(1 + (lengths[parent] if parent >= 0 else 0))
    return tuple(lengths)


class TreeTensors(NamedTuple):
    """A `DraftTree` as tensors on one device, for the passes that verify it."""

    lineage: torch.BoolTensor  # (len + 1, len): see `DraftTree.lineage`
    depths: torch.LongTensor  # (len + 1,) each node's among `[root, drafts]`: the root 0, a draft its path's length
    parent_slots: torch.LongTensor  # (len,) each draft's parent's index among `[root, drafts]`
    # (len + 1, len): the tokens a pass takes when its path ends at each node (its depth + 1) in every draft's
    # column, and in the columns of the drafts off the node's path (else 0)
    taken_grid: torch.LongTensor
    taken_off_path: torch.LongTensor
    path: torch.LongTensor  # (len + 1, depth + 1): the nodes on each node's path, root first, one a depth (then 0)
    chain: bool  # every draft follows the one before it (node i sits at depth i)


@functools.lru_cache(maxsize=SHAPES)
def _on_device(tree: DraftTree, device: str) -> TreeTensors:
    parent_slots = torch.tensor(tree.parents, dtype=torch.long) + 1
    depths = torch.cat([torch.zeros(1, dtype=torch.long), tree.depths])
    path = torch.zeros(len(tree) + 1, tree.depth + 1, dtype=torch.long)
    for draft in range(len(tree)):
        ancestors, parent = [draft + 1], tree.parents[draft]
        while parent >= 0:
            ancestors, parent = [parent + 1] + ancestors, tree.parents[parent]
        path[draft + 1, 1 : len(ancestors) + 1] = torch.tensor(ancestors)
    grid = (depths[:, None] + 1).expand(-1, len(tree)).contiguous()
    tensors = (tree.lineage, depths, parent_slots, grid, grid * ~tree.lineage, path)
    chain = tree.parents == tuple(range(-1, len(tree) - 1))
    return TreeTensors(*(tensor.to(device) for tensor in tensors), chain=chain)


@functools.lru_cache(maxsize=SHAPES)
def _scored_lineage(tree: DraftTree, num_masks: int, device: str) -> torch.BoolTensor:
    return torch.cat([tree.lineage, tree.lineage.repeat_interleave(num_masks, dim=0)]).to(device)


@functools.lru_cache(maxsize=SHAPES)
def _visibility(tree: DraftTree, num_pending: int, num_masks: int) -> torch.BoolTensor:
    k, pending, lineage = len(tree), num_pending, tree.lineage
    total = pending + k + (k + 1) * num_masks
    sees = torch.zeros(total, total, dtype=torch.bool)
    sees[:pending, :pending] = torch.ones(pending, pending, dtype=torch.bool).tril()
    sees[pending:, :pending] = True
    sees[pending : pending + k, pending : pending + k] = lineage[1:]
    for group in range(k + 1):
        start = pending + k + group * num_masks
        own = slice(start, start + num_masks)
        sees[own, pending : pending + k] = lineage[group]
        sees[own, own] = torch.ones(num_masks, num_masks, dtype=torch.bool).tril()
    return sees


def tree_attention(
    model, cache, tree: DraftTree, mask_2d, num_pending: int, num_masks: int, window=None, positions=None
):
    """The 4D attention mask of a pass, in the format of the model's attention implementation (sdpa or eager).

    Built by the mask builders of `transformers.masking_utils` from `DraftTree.visibility` (without drafts: plain
    causal) and the cache's holes (`mask_2d`), with an index-based mask function (no per-pass vmap). An sdpa mask is
    made additive here, once per pass: given a boolean mask, sdpa converts it in every layer.

    `window`: a sliding window's size, with `positions` the pass's position ids. A query then also sees only the
    keys less than `window` positions behind it:
    positions, not slots, since holes push slots apart (for the keys of a left-padded row without holes the two are
    the same test, the one `generate()` applies).
    """
    batch, device, past = cache.real.shape[0], cache.real.device, cache.length
    visible = tree.visibility(num_pending, num_masks)
    width = visible.shape[0]
    kv_length = cache.kv_length(width)  # a static cache: its every slot, the unwritten ones unseen
    seen = torch.cat([visible.new_ones(width, past), visible, visible.new_zeros(width, kv_length - past - width)], 1)
    seen = seen.to(device)  # (queries, keys), holes aside
    if window is None:
        sees = lambda b, h, q, kv: seen[q - past, kv]
    else:
        keys, queries = cache.key_positions(positions), positions
        sees = lambda b, h, q, kv: seen[q - past, kv] & (keys[b, kv] > queries[b, q - past] - window)
    mask = build_attention_mask(
        model,
        batch,
        width,
        kv_length,
        past,
        sees,
        attention_mask=None if mask_2d is None else mask_2d.bool(),
        allow_is_causal_skip=False,
        dtype=model.dtype,
        config=model.config,
        use_vmap=False,
        device=device,
    )
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.full_like(mask, torch.finfo(model.dtype).min, dtype=model.dtype).masked_fill_(mask, 0.0)
    return mask


class LookupColumns(NamedTuple):
    """The column tables `lookup` reads for `rows` texts in a buffer `width` wide (`lookup_columns`), made once by
    a pass of fixed shape."""

    rows: torch.Tensor  # (rows, 1): 0, 1, ...
    # The next three over the buffer's columns, then one more that every row sees, whose n-gram never agrees (it
    # reads only -2) and which scores `width + 1`: the best score of a row that matches nothing, read past its text
    grams: torch.Tensor  # (width + 1, n): each column's last n columns, latest first (negative ones: before the text)
    columns: torch.Tensor  # (width + 1,): 0, 1, ..., then -1
    after: torch.Tensor  # (width + 1,): 1, 2, ..., width + 1: each column's rank by lateness
    ahead: torch.Tensor  # (num_tokens,): 1, 2, ...: the columns read after the one that matched
    # (rows, num_tokens + n) put after the buffer: token 0 where lookup reads past it, then -2, which a negative
    # column reads (an index wraps), so that an n-gram over the text's start never agrees (the earlier one holds -2
    # where this one holds a token)
    tail: torch.Tensor


@functools.lru_cache(maxsize=LOOKUP_SHAPES)
def lookup_columns(rows: int, width: int, num_tokens: int, device) -> LookupColumns:
    """`LookupColumns` for `lookup(sequences, lengths, num_tokens)` of `rows` texts `width` wide, made once per shape
    (a run's text buffer keeps its width), like the trees' tables."""
    arange = functools.partial(torch.arange, device=device)
    columns = torch.cat([arange(width), arange(-1, 0)])
    grams = columns[:, None] - arange(LOOKUP_NGRAM)
    grams[-1] = -1  # -2 throughout
    after = arange(1, width + 2)
    tail = torch.tensor([0] * (num_tokens + 1) + [-2] * (LOOKUP_NGRAM - 1), device=device).expand(rows, -1)
    return LookupColumns(arange(rows)[:, None], grams, columns, after, arange(1, num_tokens + 1), tail)


def lookup(sequences, lengths, num_tokens: int, columns: LookupColumns | None = None):
    """Prompt lookup: for each row, the `num_tokens` tokens that followed the latest earlier occurrence of its last
    n tokens (n from `LOOKUP_NGRAM` down to 1, the longest that occurs), `(found, real)`; `real` is False past the
    row's text and where nothing matched. Rows are `sequences[:, :lengths]` (`lengths`: `(rows,)`, or a column).
    `columns`: `lookup_columns`' tables for this shape (made here if not given)."""
    c = columns or lookup_columns(sequences.shape[0], sequences.shape[1], num_tokens, sequences.device)
    last = (lengths if lengths.dim() == 2 else lengths[:, None]) - 1
    return lookup_in(torch.cat([sequences, c.tail], dim=1), last, c)


def lookup_in(text, last, c: LookupColumns, out=None):
    """`lookup` of a text buffer that `c.tail` already follows (a graph pass keeps it there), each row's text ending
    at column `last` (`(rows, 1)`). Every n at once, in a fixed number of ops: each column's last n tokens against
    the text's (those of column `last`), scored by how many of them agree, then by how late the column is; the best
    score names both the longest n that occurs and its latest occurrence. `out`: where to write the tokens found."""
    width = c.columns.shape[0] - 1
    grams = text[:, c.grams]  # (rows, width + 1, n)
    agree = torch.cummin(grams == grams[c.rows, last], dim=2).values.sum(dim=2)  # (rows, width + 1)
    # Each column's rank by lateness, below every longer match, at the columns where an occurrence may end (before
    # the text's last token), else 0: the best is one column's, a match's or else the extra column's, whose tokens
    # lie past every text (zeros: nothing read from there is real)
    scores = torch.add(c.after, agree, alpha=width + 1) * (c.columns < last)
    index = scores.max(dim=1, keepdim=True).indices + c.ahead
    return torch.gather(text, 1, index, out=out), index <= last
