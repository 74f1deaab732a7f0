"""Lossless draft trees, written `(B, n, L)`: block size B, n candidates for the first draft or a tuple of them per
draft depth (`mars_draft_candidates`), L tokens drafted by prompt lookup.

Apart from `bench` because the command line parses and lists trees before anything imports torch.
"""

from __future__ import annotations

# The trees `tune_lossless` tries, from a short chain of masks to wide trees with a prompt-lookup branch: narrow trees
# pay where a pass over several tokens costs noticeably more than a one-token pass (a CPU), wide ones where a pass
# costs about the same over tens of tokens (a GPU at small batch).
TUNE_TREES = ((2, 1, 0), (2, 3, 0), (2, 3, 4), (2, 2, 6), (3, 2, 4), (4, 1, 4), (4, 3, 8))
