"""Lossless draft trees, written `(B, n, L)`: block size B, n candidates for the first draft, L tokens drafted by
prompt lookup.

Apart from `bench` because the command line parses and lists trees before anything imports torch.
"""

from __future__ import annotations

# The trees `tune_lossless` tries, from a short chain of masks to wide trees with a prompt-lookup branch: narrow trees
# pay where a pass over several tokens costs noticeably more than a one-token pass (a CPU), wide ones where a pass
# costs about the same over tens of tokens (a GPU at small batch).
TUNE_TREES = ((2, 1, 0), (2, 3, 0), (2, 3, 4), (2, 2, 6), (3, 2, 4), (4, 1, 4), (4, 3, 8))


def tree_name(block: int, candidates: int, lookup: int) -> str:
    """How bench names a lossless draft tree: "B=2 n=3 L=4" (no "L=" when lookup is 0)."""
    return f"B={block} n={candidates}" + (f" L={lookup}" if lookup else "")


def parse_tree(text: str) -> tuple[int, int, int]:
    """`BxN` or `BxN+L` -> `(B, N, L)`: block size B >= 2, N >= 1 candidates for the first draft, L >= 0 tokens of
    prompt lookup (default 0)."""
    tree, _, lookup = text.partition("+")
    block, _, n = tree.partition("x")
    lookup = lookup or "0"
    if not (block.isdigit() and n.isdigit() and lookup.isdigit() and int(block) >= 2 and int(n) >= 1):
        raise ValueError(f"BxN or BxN+L with B >= 2, N >= 1, L >= 0 (e.g. 2x3+4), not {text!r}")
    return int(block), int(n), int(lookup)
