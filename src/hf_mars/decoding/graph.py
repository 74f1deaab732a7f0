"""The MARS pass: one function of fixed shapes, tensors for every number that changes, no host sync inside.

On a GPU a small model's step is bound by the host: every kernel launched from Python costs about as much as it
computes. A MARS pass does more than a plain step (acceptance, the cache's books, the next drafts), so launched op by
op it costs twice a plain step and eats the tokens it wins. Here the whole pass is one function of a `GraphPass`
(`graph_state.py`), whose tensors keep their shapes and their addresses from pass to pass: what a pass writes (the
cache slot it starts at, each row's text, positions, drafts, whether it is done) is written in place, and nothing in
it asks the host. On CUDA, under `generate()`'s compile path, the pass is captured once as a CUDA graph and replayed:
one launch and one read of `finished` per pass; elsewhere it runs compiled or eagerly (every pass on a CPU).

`graph_pass` is a pass of named phases: `_forward` (`[pending | drafts | groups of masks]` through the model, over a
4D mask of the cache's real slots and the tree's visibility), `_scored` (the logits processors), `_accept` (τ's test,
or verification of the drafts; then EOS and the length limit), `_score` (log probabilities, where asked), `_commit`
(the kept tokens into the text, the rejected drafts' slots into holes) and `_next_inputs` (the next pending tokens
and, in lossless mode, the next drafts: `_propose`). Choosing, verifying and proposing are the prompt's pass's
functions (`scoring.choose`, `verify.verify_greedy`, `verify.verify`, `verify.propose`, `tree.lookup`), written for
few ops. What it runs: greedy decoding and sampling, with the logits processors that read no more of the text than
which tokens it holds and how many (`scoring.order_free`); τ-mode with all B-1 masks in every pass (τ >= 1 accepts
slot 0 alone: exactly greedy, or sampled; with a mask cost each row uses those its schedule offers) and lossless
mode's exact verification over a whole draft tree (chain, runner-ups, prompt lookup), speculative sampling of a chain,
or typical acceptance; sliding-window layers. User stopping criteria, stop strings and a streamer are served by the
host between passes. A `Runner` (`runner.py`) holds the rows a pass decodes: whatever the entry point, every MARS
pass after the prompt's is this function.

This file is copied into MARS checkpoints (trust_remote_code).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from .cache import put_back_rows
from .commit import cut, write_taken
from .compat import CACHE_ARG
from .schedule import offers, rates_after
from .scoring import (
    Histories,
    choose,
    masks_taken,
    processed,
    scored_at_once,
    token_logprobs,
    write_into,
)
from .tree import lookup_in
from .verify import Drafts, propose, verify, verify_greedy

if TYPE_CHECKING:
    from .graph_state import GraphPass


def graph_pass(g: GraphPass) -> None:
    """One MARS pass over `[pending | drafts | groups of masks]`, everything it decides written into `g.state`."""
    logits = _forward(g)
    logits, histories = _scored(g, logits)
    tokens, accepted, path = _accept(g, logits, histories)
    if g.scoring is not None:
        _score(g, logits, histories, tokens, path)
    _commit(g, tokens, accepted, path)
    _next_inputs(g, logits, tokens, accepted, path)
    torch.all(g.state.done, out=g.state.finished)


def _forward(g: GraphPass) -> torch.Tensor:
    """The pass's forward: its slots marked in the slot map, positions counted in real tokens, a 4D mask of the slot
    map and the tree's visibility. The logits from the last pending token on, in float32."""
    shape, state = g.shape, g.state
    fed, relative, visibility, slots = g.leads[g.lead, g.tail]  # every column, or those `narrow` leaves
    (marked, fed_real), kept = g.marks[g.lead], shape.width - shape.pending + 1 - g.tail
    last, kv = g.last_column, g.attended
    if g.pruned is not None:  # lossless mode, the nodes no row drafts left out (`prune`)
        columns, relative, visibility, slots, _ = g.pruned
        fed, fed_real, marked, kept = state.fed.index_select(1, columns), fed_real[:, columns], slots, len(columns)
    state.real.index_copy_(1, marked, fed_real)
    if g.fed_rows is not None:  # the rows that decode alone (`take_rows`)
        fed, last, kv = fed[g.fed_rows], last[g.fed_rows], g.rows_view[1]
    positions = last + relative
    if shape.pending > 1 and not shape.verify:  # right-aligned pending tokens: holes on the left count back past 0
        positions.clamp_(min=0)
    out = g.forward(
        input_ids=fed,
        attention_mask=_slot_attention(g, positions, visibility, slots, g.fed_rows),
        position_ids=positions,
        use_cache=True,
        return_dict=True,
        logits_to_keep=kept,
        **{CACHE_ARG: kv},
        **({} if g.lengths else {"cache_position": slots}),  # layers that write where told (before 5.4)
    )
    if g.gathered is not None:  # the rows' K/V, with what the pass wrote, back into the cache
        put_back_rows(g.stacked, g.fed_rows, g.gathered)
    if g.lengths and (g.pruned is not None or g.tail):  # each layer's count of written slots as a whole pass's
        torch._foreach_add_(g.lengths, shape.width - len(columns) if g.pruned is not None else g.tail)
    if g.pruned is None and g.fed_rows is None and not g.tail:
        return out.logits.float()
    return _narrow_logits(g, out.logits)


def _narrow_logits(g: GraphPass, logits: torch.Tensor) -> torch.Tensor:
    """The logits of a pass that fed some rows or columns alone (`GraphPass.feed_held`), in a buffer laid out as the
    whole pass's (its other entries stale)."""
    shape = g.shape
    if g.logits_buffer is None:
        columns = shape.width - shape.pending + 1
        g.logits_buffer = logits.new_zeros(shape.batch, columns, logits.shape[-1], dtype=torch.float32)
    rows, columns = slice(None) if g.fed_rows is None else g.fed_rows, slice(logits.shape[1])
    if g.pruned is not None:
        columns = g.pruned[0]
        if isinstance(rows, torch.Tensor):  # rows by columns, not pairs
            rows = rows[:, None]
    g.logits_buffer[rows, columns] = logits.float()
    return g.logits_buffer


def _slot_attention(g: GraphPass, positions: torch.Tensor, visibility: torch.Tensor, slots: torch.Tensor, rows=None):
    """`(batch, 1, fed, reach)` additive mask of a pass whose fed columns are written at `slots`: a query sees the
    real slots before the pass and, within it, the real ones the tree allows (`visibility`: its rows for the fed
    columns). With sliding-window layers, theirs also hides the keys `window` positions or more behind a query,
    counted in positions, not slots (holes push slots apart): a real slot before the pass holds the row's token of its
    rank, the pass's own slots their fed positions. `rows`: the rows fed (`GraphPass.take_rows`), None for all."""
    real_keys, real = (g.real_keys, g.real_reach) if rows is None else (g.real_keys[rows], g.real_reach[rows])
    full = torch.where(real_keys, visibility.index_select(3, g.reach_columns), g.blocked)
    if not g.shape.window:
        return full
    keys = (real.cumsum(dim=1) - 1).index_copy_(1, slots, positions)
    near = keys[:, None, None, :] > (positions - g.shape.window)[:, None, :, None]
    sliding = torch.where(near, full, g.blocked)
    return sliding if g.shape.sliding_only else {"full_attention": full, "sliding_attention": sliding}


def _accept(g: GraphPass, logits: torch.Tensor, histories: Histories | None):
    """`(tokens, accepted, path)`: τ's test or exact verification, then EOS and the length limit. `path`: lossless
    mode's `KeptPath`; else None."""
    shape, state = g.shape, g.state
    path = masks_used = None
    offered = _offer(g) if shape.scheduled else None
    if shape.verify:
        tokens, accepted, path = _verify_by_rule(g, logits) if shape.by_rule else _verify(g, logits)
    else:
        tokens, confs = choose(logits, histories, shape.sampled, shape.confidence, noise=g.noise)
        if shape.masks:  # with a schedule, each mask's τ by the row's offer (inf past it)
            masks_used = masks_taken(confs, state.tau if offered is None else state.limits.index_select(0, offered))
            accepted = masks_used + 1
        else:  # τ >= 1 throughout: one token a pass, no masks (`cut` makes a new tensor of it)
            accepted = g.one_each
    if offered is not None:
        _reschedule(g, offered, masks_used, path)
    accepted, ended = cut(tokens, accepted, state.budget - state.decoded, state.done, g.eos)
    state.accepted_log.index_put_((state.logged,), accepted)
    state.done.logical_or_(ended)
    return tokens, accepted, path


def _offer(g: GraphPass) -> torch.Tensor:
    """`(batch,)` masks the schedule offers each row in this pass (none at τ >= 1), as a prompt's pass's `MaskSchedule`
    offers them; in lossless mode `g.on_offer` marks them (τ-mode reads them in `state.limits`). The pass still feeds
    every mask (its shape stays): a row ignores the masks past its offer."""
    offered = offers(g.state.rates, g.state.time)
    if g.shape.verify:
        torch.lt(g.depths, offered[:, None], out=g.on_offer)
    return offered


def _reschedule(g: GraphPass, offered, masks_used, path) -> None:
    """What this pass's masks were worth, into the schedule (`MaskSchedule.update`'s rule): in
    τ-mode, the masks taken (`masks_used`) of those offered now; in lossless mode, the kept drafts that the last pass's
    offered masks proposed. Each row counts the pass (`_commit` moves `state.passes` with the counters: a row that is
    done no longer reads its schedule)."""
    state = g.state
    if path is None:
        rates_after(state.rate, offered, masks_used, state.passes, g.moves, out=state.rate)
    else:
        masks_used = path.kept[:, : g.shape.tree.from_masks].sum(dim=1)
        rates_after(state.rate, state.last, masks_used, state.passes, g.moves, out=state.rate)
        state.last.copy_(offered)


class KeptPath(NamedTuple):
    """Lossless mode: the path a pass kept, and where its bonus token (the next pass's pending token) is."""

    end: torch.Tensor  # (batch,) the deepest kept node
    kept: torch.Tensor  # (batch, drafts) the drafts on its path
    source: torch.Tensor  # (batch, n) tokens, of which the bonus token is ...
    column: torch.Tensor  # (batch, 1) ... the one in this column


def _verify(g: GraphPass, logits: torch.Tensor):
    """Exact verification of the tree from its (processed) scores (`verify.verify_greedy`, a prompt's pass's own):
    `(tokens, accepted, KeptPath)`. The model's tokens at the tree's nodes alone: the masks' logits are the next
    drafts' (`_propose`)."""
    if g.pruned is None:
        target = logits[:, : len(g.shape.tree) + 1].argmax(dim=-1)
    else:  # the nodes fed alone (`prune`): the others' logits are stale, and their drafts not real
        fed, target = g.pruned[0][: g.nodes_fed + 1], g.targets
        target.index_copy_(1, fed, logits.index_select(1, fed).argmax(dim=-1))
    tokens, accepted, end, kept = verify_greedy(target, g.drafts, g.drafts_real, g.tree)
    return tokens, accepted, KeptPath(end, kept, target, end[:, None])  # the bonus token: the model's at `end`


def _verify_by_rule(g: GraphPass, logits: torch.Tensor):
    """Speculative sampling or typical acceptance of the (processed) scores, by `verify.verify` itself (as a prompt's):
    `_verify`'s `(tokens, accepted, KeptPath)`. Speculative sampling (a chain) reads the drafts a pass fed alone
    (`prune`): one random number per draft fed, as a prompt's pass draws them, so that at τ = 1 a seed draws plain
    sampling's tokens."""
    shape = g.shape
    fed = g.nodes_fed if shape.sampled and shape.typical is None else len(shape.tree)
    proposals = g.proposals if g.proposals is None or fed == len(shape.tree) else g.proposals[:, : fed + 1]
    drafts = Drafts(g.drafts[:, :fed], g.drafts_real[:, :fed], shape.tree, proposals)
    nodes = logits[:, : fed + 1]
    tokens, accepted, kept, end = verify(nodes, drafts, None, shape.sampled, shape.typical, g.tree, g.rows)
    if fed < len(shape.tree):  # the chain's drafts left out: none kept
        tokens = torch.nn.functional.pad(tokens, (0, len(shape.tree) - fed))
        kept = torch.nn.functional.pad(kept, (0, len(shape.tree) - fed))
    depth = end if g.tree.chain else accepted - 1  # a chain's node is its depth
    return tokens, accepted, KeptPath(end, kept, tokens, depth.unsqueeze(1))


def _score(g: GraphPass, logits, histories: Histories | None, tokens, path) -> None:
    """Each decided token's log probability and the likeliest tokens at its slot (`GraphPass.record_scores`), from the
    outputs that decided it, as a prompt's pass finds them (`deciding`): τ-mode's slots in order; lossless mode's root,
    then each kept draft's node on the path. Before `_commit`: a slot's scores are processed after the history as it
    stood before the pass and the tokens before it."""
    if path is not None and not g.tree.chain:
        on_path = g.tree.path.index_select(0, path.end)  # (batch, depth + 1)
        deciding = logits.gather(1, on_path[..., None].expand(-1, -1, logits.shape[-1]))
    else:
        deciding = logits[:, : tokens.shape[1]]
    for buffer, value in zip(g.scores, token_logprobs(deciding, histories, tokens, g.scoring)):
        if buffer is not None:
            buffer.copy_(value)


def _commit(g: GraphPass, tokens, accepted, path) -> None:
    """The pending tokens and kept drafts stay cached, the rejected drafts as holes; the cache steps back over the
    masks, which the next pass overwrites. The accepted tokens go into the text."""
    state = g.state
    if path is not None:  # lossless: the drafts off the kept path become holes
        order = g.pruned[4] if g.pruned is not None else None  # the nodes a pruned pass fed come first
        state.real.index_copy_(1, g.draft_slots, path.kept if order is None else path.kept.index_select(1, order))
    untaken = g.untaken.index_select(0, accepted)
    columns = g.decoded_column + state.write_offsets
    write_taken(state.sequences, g.rows, columns, tokens, untaken, g.shape.pad_token_id)
    if g.seen_tokens or g.spare_text is not None:  # the spare id where a row did not take it
        taken = tokens.masked_fill(untaken, g.vocab)
        for held in g.seen_tokens:  # the taken tokens, held now (those not taken into the spare column)
            held.scatter_(1, taken, True)
        if g.spare_text is not None:  # over the tokens that this pass's slots wrote after each history
            g.spare_text.index_put_((g.rows, columns), taken)
    torch._foreach_add_(g.counters, g.counter_steps)
    torch._foreach_add_([state.decoded, state.text_end, state.text_last, state.last_position], [accepted] * 4)


def _next_inputs(g: GraphPass, logits, tokens, accepted, path) -> None:
    """τ-mode: the accepted tokens, right-aligned. Lossless mode: the last token, and the drafts that the group of
    masks after the last kept draft proposes (the full tree, unfilled slots not real). A row that is done feeds
    no drafts, and once its last tokens are cached (the pass after it stopped) nothing real, so that its idle passes
    fill no more slots of the cache."""
    shape = g.shape
    if not shape.verify:  # the holes on the left hold any token: nothing sees them
        if shape.pending == 1:
            g.pending.copy_(tokens)
        else:
            write_into(g.pending, torch.gather, tokens, 1, g.align.index_select(0, accepted))
        write_into(g.pending_real, torch.index_select, g.align_real, 0, accepted)
        return
    write_into(g.pending, torch.gather, path.source, 1, path.column)  # the bonus token (a row that took fewer is done)
    g.pending_real.copy_(g.live_column)  # real unless the row was done before this pass
    torch.logical_not(g.state.done, out=g.live)
    if len(shape.tree):
        _propose(g, logits, path.end)


def _propose(g: GraphPass, logits, end) -> None:
    """The next drafts, as a prompt's pass makes them (`verify.propose`, then `tree.lookup` as `verify.add_lookup` adds
    its branch), written in the full tree's shape: from the masks after each row's `end`, the chain of confident
    tokens and their runner-ups (greedy or typical acceptance), drawn with the distributions they were drawn from
    (speculative sampling), then prompt lookup's branch. A slot that is not real holds any token, which nothing sees;
    a row that is done feeds none."""
    shape, state = g.shape, g.state
    if not g.masks_fed:  # no mask fed (τ >= 1, `prune`): none proposes, and no random number is drawn for them
        g.from_masks_real.fill_(False)
        if g.proposals is not None:
            g.proposed.zero_()
    else:
        _propose_from_masks(g, logits, end)
    if shape.lookup:
        found, real = lookup_in(state.text, g.text_last_column, g.lookup, out=g.from_lookup)
        write_into(g.from_lookup_real, torch.logical_and, real, g.live_column)


def _propose_from_masks(g: GraphPass, logits, end) -> None:
    """`_propose`'s drafts from the masks after each row's `end`."""
    shape, state = g.shape, g.state
    followed = logits[g.rows, g.group.index_select(0, end)]  # (batch, masks, vocab): the masks after `end`
    sampled = shape.sampled and shape.typical is None
    on_offer = g.on_offer if shape.scheduled or g.masks_limit < shape.masks else None
    buffer = None if g.proposals is None else g.proposed
    tau, measure, candidates = state.tau, shape.confidence, shape.candidates
    histories = g.histories() if shape.calls else None  # raw masks, scored after the text as it now stands
    drafts = propose(followed, histories, tau, on_offer, measure, sampled, candidates, None, buffer=buffer)
    g.from_masks.copy_(drafts.tokens)
    write_into(g.from_masks_real, torch.logical_and, drafts.real, g.live_column)


def _scored(g: GraphPass, logits: torch.Tensor) -> tuple[torch.Tensor, Histories | None]:
    """`(scores, histories)`: the pass's scores processed for every slot at once where that can be (warpers alone;
    every processor in lossless mode, each slot after its path: `scoring.scored_at_once`, as a graph pass runs only
    processors that `scoring.by_rules` applies), histories None; else (τ-mode, processors that read the history) the
    raw scores, and what `scoring.choose` reads slot by slot (`scoring.Histories`: every row's text as it stands)."""
    if not g.processors:
        return logits, None
    if not g.shape.reads_text:  # warpers alone: every slot in one call
        return processed(logits, Histories(g.processors, g.state.sequences, None, None, ids=g.ids), None), None
    histories = g.histories()
    if g.shape.verify and g.shape.calls:  # the chain's nodes, each after the drafts before it (the masks' stay raw)
        nodes = len(g.shape.tree) + 1
        return torch.cat([processed(logits[:, :nodes], histories, g.drafts), logits[:, nodes:]], dim=1), None
    if g.shape.verify:
        return scored_at_once(logits, histories, g.drafts, g.scored_lineage), None
    return logits, histories
