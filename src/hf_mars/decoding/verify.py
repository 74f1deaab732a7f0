"""Lossless mode (`mars_verify`): mask predictions become drafts, which the next pass verifies.

Each pass feeds the drafts of the last one as real tokens and keeps those equal to the model's own prediction at
their parent (greedy), or accepts them by speculative sampling; the output is then exactly the model's own. The same
pass proposes the next drafts from the group of masks that followed its last kept draft: a chain (mask j's top token
follows mask j-1's), runner-ups (`mars_draft_candidates`), and a branch of prompt lookup (`mars_lookup`).

Runner-ups: with k_d candidates at depth d, mask d's next k_d - 1 tokens are siblings of the chain's depth-d draft
(they follow the chain's depth d-1 draft, or the root), leaves of the tree. An int N is `[N, 1, 1, ...]`: runner-ups
for the first draft only. A mask's prediction does not depend on the drafts before it, so its runner-ups may follow
any draft of the depth above; the chain is where a path most often continues, so that is where they go.

`mars_accept="typical"` keeps a draft the model finds plausible rather than only its own choice (`_verify_typical`):
more tokens per pass, other answers. Its drafts are the greedy tree's, with sampling too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .scoring import choose, draw, processed, write_into
from .tree import NO_DRAFTS, DraftTree, depth_candidates, lookup


@dataclass
class Drafts:
    """The unverified guesses a pass feeds after its pending tokens, for the rows still decoding.

    Attributes:
        tokens (`(rows, len(tree))`): the drafts, pad where a row has none in that slot.
        real (`(rows, len(tree))`): which slots hold a draft of that row.
        tree: their shape, shared by the rows.
        proposals (`(rows, len(tree) + 1, vocab)`, sampling only): the distribution each draft was drawn from
            (zero where it would not have been proposed), and the next position's.
    """

    tokens: torch.Tensor
    real: torch.Tensor
    tree: DraftTree = NO_DRAFTS
    proposals: torch.Tensor | None = None

    @classmethod
    def none(cls, rows: int, device) -> Drafts:
        return cls(
            torch.empty(rows, 0, dtype=torch.long, device=device),
            torch.empty(rows, 0, dtype=torch.bool, device=device),
        )


def verify(
    logits,
    drafts: Drafts,
    histories,
    do_sample: bool,
    typical: tuple[float, float] | None = None,
    tree=None,
    rows=None,
):
    """Verify the drafts: `(tokens, accepted, kept, end)`.

    `logits[:, 0]` is the output at the last pending token (the root), `logits[:, 1 + i]` the output at draft i, so
    the output at a draft's parent is the model's own prediction of it. `tokens[:, :accepted]` are the row's new
    tokens; `kept` marks the kept drafts (whose K/V the cache keeps); `end` is where they end (0: the root).
    `typical`: `(ε, δ)` of typical acceptance (`_verify_typical`) instead of exact verification. `tree`: the drafts'
    `TreeTensors` where the caller holds them (a graph pass, which then builds no tensor from the host: compiled, it
    would copy them to the device in every pass); None: `drafts.tree`'s, made once per device. `rows`: `(rows, 1)`,
    each row's index, where the caller holds them (None: made here).
    """
    tree = drafts.tree.on(logits.device) if tree is None else tree
    scores = processed(logits, histories, drafts.tokens, tree.lineage)
    if (typical is not None or do_sample) and rows is None:  # they index each row's position
        rows = torch.arange(logits.shape[0], device=logits.device)[:, None]
    if typical is not None:
        return _verify_typical(scores, drafts, tree, rows, do_sample, *typical)
    if do_sample:
        return _verify_sampled(scores, drafts, rows)
    target = scores.argmax(dim=-1)  # (rows, 1 + drafts)
    tokens, accepted, end, kept = verify_greedy(target, drafts.tokens, drafts.real, tree)
    return tokens, accepted, kept, end


def verify_greedy(target, drafts, real, tree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact verification of greedy drafts: `(tokens, accepted, end, kept)`. `target` holds the model's token at each
    node of `[root, drafts]` (first), `drafts`/`real` the drafts fed and which are real, `tree` their `TreeTensors`.
    A node is kept when every draft on its path equals the model's token at its parent; the deepest kept node `end`
    (of equal depths, the first in the tree) ends the path, and the row's `accepted` new tokens (its depth + 1) are
    the model's own at the root and at each node on that path (`tokens[:, :accepted]`: each kept draft, then the
    bonus token, which is also `target`'s at `end`); `kept` marks the drafts on the path."""
    width = drafts.shape[1]
    parents = target[:, :width] if tree.chain else target.index_select(1, tree.parent_slots)  # a chain's: in order
    accepted, end, kept = deepest_kept((drafts == parents) & real, tree)
    if tree.chain:  # the path to node d holds the first d drafts: the model's tokens on it are `target`'s first d + 1
        return target[:, : width + 1], accepted, end, kept
    return target.gather(1, tree.path.index_select(0, end)), accepted, end, kept


def _verify_typical(scores, drafts: Drafts, tree, rows, do_sample: bool, epsilon: float, delta: float):
    """Typical acceptance (Medusa): a draft matches when the verifying distribution p at its parent gives it at least
    min(ε, δ·exp(-H(p))), and its parent matches. Not lossless: a plausible draft is kept where the model would have
    chosen another token; the bar falls where p is spread out (high entropy), where many continuations are fine. The
    token after the deepest match is p's argmax there (greedy) or drawn from p (sampling, p after the warpers). With
    δ <= 1 the argmax always passes (max p >= exp(-H)), and with ε > 0.5 only the argmax can: then it is exact."""
    p = torch.softmax(scores.float(), dim=-1)
    match = drafts.real
    if len(drafts.tree):
        parents = tree.parent_slots
        bar = (delta * torch.exp(-torch.special.entr(p).sum(dim=-1))).clamp(max=epsilon)  # (rows, 1 + drafts)
        p_draft = p[:, parents].gather(-1, drafts.tokens[..., None]).squeeze(-1)
        match = (p_draft >= bar[:, parents]) & drafts.real

    def after(end):
        at_end = p[rows, end[:, None]]  # (rows, 1, vocab)
        return draw(at_end) if do_sample else at_end.argmax(dim=-1)

    return _keep_deepest(match, drafts, tree, after)


def _keep_deepest(match, drafts: Drafts, tree, after):
    """Keep the path to the deepest draft that matches with all its ancestors (equal siblings give equal paths; of
    different ones, the first in the tree, the chain's), then `after(end)`, the `(rows, 1)` token that follows where
    it ends (the correction, or a bonus token). `(tokens, accepted, kept, end)` as `verify` returns them."""
    rows = match.shape[0]
    count = end = torch.zeros(rows, dtype=torch.long, device=match.device)
    if not len(drafts.tree):
        return after(end), count + 1, drafts.real, end
    accepted, end, kept = deepest_kept(match, tree)
    path = drafts.tokens.gather(1, (tree.path[end, 1:] - 1).clamp(min=0))  # the drafts on the path, one a depth
    tokens = torch.nn.functional.pad(path, (0, 1)).scatter_(1, accepted[:, None] - 1, after(end))
    return tokens, accepted, kept, end


def deepest_kept(match, tree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(accepted, end, kept)`: the deepest node of the tree (`TreeTensors`) whose path's drafts all `match`, by its
    index among `[root, drafts]` (of equal depths, the first in the tree, the chain's; the root, depth 0, when none),
    the tokens a pass whose path ends there takes (its depth + 1), and the drafts on its path."""
    if tree.chain or not match.shape[1]:  # node i sits at depth i, its path holds the first i drafts: leading matches
        kept = torch.cummin(match, dim=1).values
        depth = kept.sum(dim=1)
        return depth + 1, depth, kept
    # (rows, nodes): each node's depth + 1 where every draft on its path matches, else 0 (the root's path has none)
    reached = torch.where(match[:, None, :], tree.taken_grid, tree.taken_off_path).amin(dim=2)
    accepted, end = reached.max(dim=1)
    return accepted, end, tree.lineage.index_select(0, end)


def _verify_sampled(scores, drafts: Drafts, rows):
    """Speculative sampling with a partial proposal (the drafts are a chain): draft j is kept with probability
    min(1, p_j(d) / q'_j(d)); the token after the last kept one is drawn from max(0, p - q') renormalised. So the
    tokens are distributed exactly as the model samples them. q'_j is what mask j proposes: the mass of the tokens it
    would offer as a draft (with τ's test by probability, those at least τ likely), none past the masks offered. Only
    the drafts fed and the position after them are read: verification stops at or before the first position where
    no draft was fed."""
    tokens, proposals = drafts.tokens, drafts.proposals
    if proposals is None or proposals.shape[1] != tokens.shape[1] + 1:  # no drafts: sample p
        proposals = scores.new_zeros(tokens.shape[0], tokens.shape[1] + 1, scores.shape[-1])
    p = torch.softmax(scores, dim=-1)
    # p / q' of each draft (a real one was proposed: q' > 0), gathered from the first `drafts` slots, each after its
    # parent; kept with probability min(1, p / q')
    ratio = (p / proposals).gather(-1, tokens[..., None])
    match = (torch.rand_like(ratio) < ratio).squeeze(-1) & drafts.real
    kept = torch.cummin(match, dim=1).values  # the drafts before the first rejected one
    count = kept.sum(dim=1)
    at = count[:, None]  # (rows, 1): the position after the last kept draft
    p_next = p[rows, at]  # (rows, 1, vocab)
    residual = (p_next - proposals[rows, at]).clamp_(min=0)
    residual = torch.where(residual.any(dim=-1, keepdim=True), residual, p_next)  # all 0: p equals q' (rounding)
    target = draw(residual)  # (rows, 1)
    out = torch.cat([tokens, target], dim=1).scatter_(1, at, target)
    return out, count + 1, kept, count


def propose(
    followed,
    histories,
    tau: float,
    on_offer,
    measure: str,
    do_sample: bool,
    candidates,
    pad_token_id: int,
    buffer=None,
):
    """The next drafts from the masks that followed each row's last kept token (`followed`: `(rows, masks, vocab)`).

    A chain of the masks' confident tokens, plus confident runner-ups at the depths `candidates` (an int or per-depth
    counts, `mars_draft_candidates`) gives them, each where the chain reaches its depth (greedy only). With sampling,
    each draft keeps the distribution it was drawn from, zeroed where it would not have been proposed, which is what
    speculative sampling needs. The tree always has its whole shape, filled or not, so that a runner's every pass has
    one (a slot no row fills is not real). `on_offer`: the masks each row was offered (None: all);
    `pad_token_id`: what a slot that is not real holds (None: any token, which nothing sees). `buffer`: where the
    caller keeps the proposals (a graph pass: the first `masks` positions of a buffer whose next one stays zero),
    written in place and returned as the drafts' own.

    `histories`: what processors read, where `followed` is raw (each mask then scored after the drafts chosen before
    it, as τ-mode's tokens are); None where `followed` holds processed scores (`scoring.scored_at_once`).
    """
    guesses, confs, q = choose(followed, histories, do_sample, measure, True)
    confident = confs >= tau if on_offer is None else (confs >= tau) & on_offer
    prefix = torch.cummin(confident, dim=1).values  # up to the first unconfident mask
    counts = depth_candidates(candidates, followed.shape[1])
    count = prefix.sum(dim=1) if max(counts, default=1) > 1 else None  # each row's chain length, for runner-ups
    others = _runner_ups(q, guesses, count, tau, counts)
    chain, real = followed.shape[1], prefix
    tokens = _padded(guesses, real, pad_token_id)
    parents = tuple(range(-1, chain - 1))
    for depth, siblings, sibling_real in others:  # every depth is the chain's: it is as long as the masks
        tokens = torch.cat([tokens, _padded(siblings, sibling_real, pad_token_id)], dim=1)
        real = torch.cat([real, sibling_real], dim=1)
        parents += (depth - 2,) * siblings.shape[1]  # after the chain's draft of the depth above (-1: the root)
    proposals = None
    if do_sample:  # q': what each mask would have proposed, and nothing past the masks (see `_verify_sampled`)
        proposed = (q >= tau) if measure == "probability" else confident[..., None]
        proposed = proposed if on_offer is None else proposed & on_offer[..., None]
        proposals = _proposals(q, proposed, chain, buffer)
    return Drafts(tokens, real, DraftTree.of(parents), proposals)


def _proposals(q, proposed, chain: int, buffer=None):
    """q': q where `proposed`, up to the chain's end, then the position after it, where nothing is proposed; or
    written into the caller's `buffer` (`propose`)."""
    if buffer is None:
        proposals = torch.nn.functional.pad(q * proposed, (0, 0, 0, 1))
        return proposals if chain >= q.shape[1] else proposals[:, : chain + 1]
    write_into(buffer, torch.mul, q, proposed)
    return buffer


def _padded(tokens, real, pad_token_id):
    """`tokens` with `pad_token_id` where not `real` (None: as they are)."""
    return tokens if pad_token_id is None else torch.where(real, tokens, pad_token_id)


def _runner_ups(q, guesses, count, tau: float, counts: tuple[int, ...]) -> list:
    """`(depth, tokens, real)` for each depth d with `counts[d - 1] > 1`: mask d's most probable tokens after its top
    one, real where confident and where the row's chain reaches depth d."""
    found = []
    for depth, k in enumerate(counts, start=1):
        if k > 1:
            rest = q[:, depth - 1].scatter(1, guesses[:, depth - 1 : depth], -1.0)  # not the chain's draft (ties)
            probs, tokens = rest.topk(k - 1, dim=-1)
            found.append((depth, tokens, (probs >= tau) & (count >= depth)[:, None]))
    return found


def add_lookup(drafts: Drafts, sequences, lengths, num_tokens: int, pad_token_id: int) -> Drafts:
    """One more branch: what followed the text's last n-gram where it occurred before (`tree.lookup`), all
    `num_tokens` slots of it, found or not (see `propose`)."""
    found, found_real = lookup(sequences, lengths, num_tokens)
    start = len(drafts.tree)
    tokens = torch.cat([drafts.tokens, _padded(found, found_real, pad_token_id)], dim=1)
    real = torch.cat([drafts.real, found_real], dim=1)
    parents = drafts.tree.parents + (-1,) + tuple(range(start, start + num_tokens - 1))
    return Drafts(tokens, real, DraftTree.of(parents, start), drafts.proposals)
