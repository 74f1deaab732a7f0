"""The MARS pass as one graph: fixed shapes, tensors for every number that changes, no host sync inside.

On a GPU a small model's step is bound by the host: every kernel launched from Python costs about as much as it
computes. A MARS pass does more than a plain step (acceptance, the cache's books, the next drafts), so launched op by
op it costs twice a plain step and eats the tokens it wins. Here the whole pass is one function of a `GraphState`,
whose tensors keep their shapes and their addresses from pass to pass: what a pass writes (the cache slot it starts
at, each row's text, positions, drafts, whether it is done) is written in place, and nothing in it asks the host.
On CUDA, under `generate()`'s compile path, the pass is captured once as a CUDA graph (the forward compiled by
inductor inside it) and replayed: one launch and one read of `finished` per pass. On other devices under that path
the whole pass is one compiled function; without it the same function runs eagerly (every pass on a CPU, and a call
with processors only transformers applies), which is what the tests check.

What it runs: a static cache; greedy decoding and sampling, with the logits processors that read no more of the text
than which tokens it holds and how many (`scoring.order_free`: the warpers, bans and biases of single tokens, a
repetition penalty, minimum lengths);
τ-mode with all B-1 masks in every pass (τ >= 1 then accepts slot 0 alone: exactly greedy, or sampled; with a mask cost
each row uses those its schedule offers) and lossless mode's exact verification over a whole draft tree (chain,
runner-ups, prompt lookup), speculative sampling of a chain, or typical acceptance; sliding-window layers, whose
windows the pass's masks hold. Choosing, verifying and proposing are the prompt's pass's functions (`scoring.choose`,
`verify.verify_greedy`, `verify.verify`, `verify.propose`, `tree.lookup`), written for few ops; this file adds
what a pass of fixed shape needs around them. User stopping criteria, stop strings and a streamer are served by the
host between passes. A `Runner` (`runner.py`) holds the rows a pass decodes: whatever the entry point, every MARS
pass after the prompt's is this file's `graph_pass`.

This file is copied into MARS checkpoints (trust_remote_code).
"""

from __future__ import annotations

import itertools
import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from .cache import cache_view, compact_static, gathered_cache, pass_positions, put_back_rows, stacked_layers
from .commit import cut, right_align, write_taken
from .compat import CACHE_ARG, counts_static_writes, many_shapes, static_cache_size
from .schedule import masks_covering, offers, rate_moves, rates_after
from .scoring import (
    NGRAM_BANS,
    SET_BASED,
    Histories,
    by_rules,
    choose,
    history_free,
    kept_noise,
    masks_taken,
    processed,
    processors_signature,
    scored_at_once,
    token_logprobs,
    write_into,
)
from .tree import DraftTree, lookup_columns, lookup_in
from .verify import Drafts, propose, verify, verify_greedy

WARMUP_PASSES = 2  # eager passes (real ones) before a CUDA graph is captured, as CUDA's capture rules ask
# Slots an eager pass's attention reach grows by (`GraphPass.attend`): a new reach costs a view of each layer once, so
# it moves every pass or two at most, while attention reads few slots past the text
REACH_STEP = 32
GRAPHS_KEPT = 8  # graph passes kept per model (their buffers and tables; K/V only where `captured`)
SPARES_KEPT = 3  # more passes of one shape kept for threads that decode it at once
# Whether an eager τ-mode pass on a CPU feeds only the pending columns some row holds (`GraphPass.narrow`): there a
# pass costs its compute, and holes are compute spent on nothing; on a GPU a pass keeps its shape (launches are the
# cost). Tools that count a GPU's host ops on a CPU turn it off
NARROWS = True
# An eager pass on a CPU leaves out the idle rows between the rows it feeds (`GraphPass.take_rows`) where the compute
# saved, about 2 FLOPs per parameter and fed column, outweighs copying the fed rows' K/V out and back, at this many
# FLOPs per byte copied: the order of a CPU core's matmul throughput over its memory bandwidth
FLOPS_PER_BYTE_COPIED = 10
PRUNES_KEPT = 64  # `prune`'s tables kept per pass: one per set of tree nodes fed, which few passes vary
# Whether a pass captured on CUDA is compiled whole (its bookkeeping fused with the forward by inductor, then captured
# as one CUDA graph) rather than its forward alone; off until a GPU's measurements choose it. Tools turn it on.
FUSED = False


@dataclass(frozen=True)
class GraphShape:
    """Everything Python decides about a graph pass: its shapes and its code. Passes of equal shape share a graph."""

    batch: int
    slots: int  # static cache slots (the text buffer is as wide)
    verify: bool
    pending: int  # pending tokens fed per pass (τ-mode: B, right-aligned; lossless: the root)
    tree: DraftTree  # lossless mode's full draft tree (empty in τ-mode)
    masks: int  # masks per group (B - 1; 0 in τ-mode at a constant τ >= 1)
    confidence: str
    candidates: int | tuple[int, ...]
    lookup: int
    mask_token_id: int
    pad_token_id: int
    eos: int  # how many EOS ids (their values are copied in with each run's state)
    sampled: bool = False  # tokens drawn from the (processed) distribution, as `do_sample=True` draws them
    typical: tuple[float, float] | None = None  # lossless mode: typical acceptance's `(ε, δ)`; None: exact
    processors: tuple = ()  # what the logits processors applied to every slot are (`processors_signature`)
    reads_text: bool = False  # some processor reads each slot's history (a repetition penalty, a minimum length)
    calls: bool = False  # some processor is transformers' own, called on each slot's text (eager passes alone)
    window: int = 0  # positions a sliding-window layer sees (0: no such layers)
    sliding_only: bool = False  # every layer slides: one mask for all (else masks by layer type)
    scheduled: bool = False  # a mask schedule (`mars_mask_cost`): each row uses the masks it is offered

    @property
    def by_rule(self) -> bool:
        """Lossless mode verifying by `verify.verify` (speculative sampling, typical acceptance), not by the greedy
        match of the (processed) scores."""
        return self.verify and (self.sampled or self.typical is not None)

    @property
    def groups(self) -> int:
        return len(self.tree) + 1 if self.verify else 1

    @property
    def kept(self) -> int:
        """Slots a pass commits (the pending tokens and drafts); the masks' slots after them are written again."""
        return self.pending + len(self.tree)

    @property
    def width(self) -> int:
        return self.kept + self.groups * self.masks

    @property
    def tokens(self) -> int:
        """Tokens a pass may take: the tree's depth and one (lossless), the pending slots (τ-mode)."""
        return self.tree.depth + 1 if self.verify else self.pending


def processor_fields(processors) -> dict:
    """The `GraphShape` fields that say what a pass's logits processors are and how it applies them."""
    return dict(
        processors=processors_signature(processors),
        reads_text=not history_free(processors),
        calls=not by_rules(processors),
    )


@dataclass
class GraphState:
    """What a graph pass reads and writes in place, for every row of the batch (rows stay until all are done)."""

    sequences: torch.Tensor  # (batch, slots): prompt, then the decoded tokens, then pad (a view of `text`)
    text: torch.Tensor  # (batch, slots + lookup's tail): `sequences`, then the columns prompt lookup reads past it
    write_offsets: torch.Tensor  # (batch, tokens a pass may take) where each row's text starts + 0, 1, ...
    budget: torch.Tensor  # (batch,) new tokens each row may take
    decoded: torch.Tensor  # (batch,) new tokens decoded
    text_end: torch.Tensor  # (batch,) where each row's text ends: where it starts (`write_offsets[:, 0]`) + decoded
    text_last: torch.Tensor  # (batch,) its last column: `text_end - 1`
    done: torch.Tensor  # (batch,) rows that reached EOS or the length limit
    finished: torch.Tensor  # () every row done
    real: torch.Tensor  # (batch, slots) which cache slots hold real tokens (before the slots the next pass writes)
    last_position: torch.Tensor  # (batch,) position id of each row's last pending token
    fed: torch.Tensor  # (batch, width) the pass's input: pending tokens, drafts, then the masks (written once)
    fed_real: torch.Tensor  # (batch, width) which of them are real (the masks always)
    tau: torch.Tensor  # () the τ of the next pass (inf: accept or propose nothing)
    limits: torch.Tensor  # (masks + 1, masks) τ-mode: what each mask's token must score, by the row's offer
    logged: torch.Tensor  # (1,) passes run since the log was last emptied: the row of `accepted_log` the next writes
    accepted_log: torch.Tensor  # (slots, batch) tokens each row took in each pass
    rates: torch.Tensor  # (batch, masks + 1) ones (zeros at τ >= 1: no offer), then the schedule's acceptance rates
    rate: torch.Tensor  # (batch, masks) those rates (`MaskSchedule.rate`), a view
    time: torch.Tensor  # (masks + 1,) what a pass with 0, 1, ... masks costs (`MaskSchedule.time`)
    last: torch.Tensor  # (batch,) lossless mode: masks offered in the last pass
    passes: torch.Tensor  # (batch,) passes each row decoded in (the schedule probes every few)

    @classmethod
    def empty(cls, shape: GraphShape, device) -> GraphState:
        batch, slots, kept = shape.batch, shape.slots, shape.kept
        long = dict(dtype=torch.long, device=device)
        flag = dict(dtype=torch.bool, device=device)
        fed, fed_real = torch.zeros(batch, shape.width, **long), torch.zeros(batch, shape.width, **flag)
        fed[:, kept:], fed_real[:, kept:] = shape.mask_token_id, True
        text = torch.zeros(batch, slots, **long)
        rates = torch.ones(batch, shape.masks + 1, dtype=torch.float64, device=device)
        if shape.lookup:  # lookup's tail after the buffer, written once
            text = torch.cat([text, lookup_columns(batch, slots, shape.lookup, device).tail], dim=1)
        return cls(
            sequences=text[:, :slots],
            text=text,
            write_offsets=torch.zeros(batch, shape.tokens, **long),
            budget=torch.zeros(batch, **long),
            decoded=torch.zeros(batch, **long),
            text_end=torch.zeros(batch, **long),
            text_last=torch.zeros(batch, **long),
            done=torch.zeros(batch, **flag),
            finished=torch.zeros((), **flag),
            real=torch.zeros(batch, slots, **flag),
            last_position=torch.zeros(batch, **long),
            fed=fed,
            fed_real=fed_real,
            tau=torch.zeros((), dtype=torch.float32, device=device),
            limits=torch.zeros(shape.masks + 1, shape.masks, dtype=torch.float32, device=device),
            logged=torch.zeros(1, **long),
            accepted_log=torch.zeros(slots, batch, **long),
            rates=rates,
            rate=rates[:, 1:],
            time=torch.zeros(shape.masks + 1, dtype=torch.float64, device=device),
            last=torch.zeros(batch, **long),
            passes=torch.zeros(batch, **long),
        )


class GraphPass:
    """One shape's pass, its state and (on CUDA, compiled) its captured graph: `run()` decodes one pass.

    Everything a pass needs that does not change from pass to pass is built here once, as tables that a pass reads
    with one index each: which slots a query sees (by key slot minus pass slot), where each fed token sits, and, for
    lossless mode, each tree node's lineage, path and group of masks. A GPU launches each eager op of a pass as a
    kernel of its own, so a pass is written to launch few: views made here once, several counters moved by one
    `_foreach_add_`, tables instead of arithmetic.
    """

    def __init__(self, model, kv, shape: GraphShape, compile_config=None, processors=None):
        """`compile_config`: `generate()`'s, where it compiles, else None (eager). On CUDA the pass is then captured
        whole as a CUDA graph, around a forward compiled without CUDA graphs of its own or, with `FUSED`, compiled
        whole first; elsewhere the whole pass is compiled as one function. A pass makes no tensor from host data (the
        tree's tables are made here): compiled, it would copy them to the device in every pass, which capture
        refuses. `processors`: the run's logits processors (`scoring.order_free`; `shape.processors` names them)."""
        self.model, self.shape = model, shape
        device = kv.layers[0].keys.device
        self.state = state = GraphState.empty(shape, device)
        on_cuda = captured(device, compile_config is not None)
        self.capture = on_cuda  # sampling too: `scoring.draw` reads nothing back from the device
        self.forward, self.pass_function = model, graph_pass
        self.eager = compile_config is None  # shapes may change between passes (`attend`, `feed_held`)
        self.narrows = self.eager and device.type == "cpu"  # where a pass costs its compute (`feed_held`)
        if on_cuda and not FUSED:  # the forward compiled without CUDA graphs of its own; the pass around it captured
            self.forward = _compiled(model.__call__, compile_config, "default")
        elif compile_config is not None:  # the whole pass compiled as one function (on CUDA, then captured whole)
            self.pass_function = _compiled(graph_pass, compile_config, "default" if on_cuda else None)
        self.eos = torch.zeros(shape.eos, dtype=torch.long, device=device)
        self._views(shape, state)
        for name, table in _tables(shape, model.dtype).items():
            setattr(self, name, table.to(device))
        self.visibility_at = self.key_columns.clone()  # the column of `visibility` each key slot reads (`move_to`)
        self.whole = (
            state.real,
            state.real[:, None, None, :],
            self.visibility_at,
        )  # what attention reads of them
        self.lead, self.tail = 0, 0  # `narrow`'s cut, and its views
        self.leads = {(0, 0): (state.fed, self.relative, self.visibility, self.slots)}
        self.marks = {0: (self.slots, state.fed_real)}
        self.masks_fed, self.nodes_fed = shape.masks, len(shape.tree)  # what the pass feeds (`feed_held`)
        self.nodes_drafted = None  # the tree's nodes a runner's rows draft now (`Runner.retree`), None: every one
        self.masks_limit = shape.masks  # the masks per group they use (a smaller block's tree: `within` marks them)
        self.tau = 1.0  # τ, as `set_tau` last set it
        self.pruned, self.prunes = None, {}  # `prune`'s tables
        self.fed_rows = self.rows_view = self.gathered = None  # `take_rows`' rows, their cache, their K/V copied
        self.flops_per_column = 2 * model.num_parameters()  # what a row's fed column costs, past `bound_columns`
        # Up to about this many fed columns a CPU's matmuls wait on reading the weights, not on their FLOPs: a
        # pass costs no more for the rows it feeds (reading a weight's bytes takes FLOPS_PER_BYTE_COPIED FLOPs' time)
        self.bound_columns = FLOPS_PER_BYTE_COPIED * model.dtype.itemsize // 2
        self.logits_buffer = None  # a pass's logits where it fed some rows or columns alone (`_narrow_logits`)
        self.tree = shape.tree.on(device)
        self.targets = torch.zeros(shape.batch, len(shape.tree) + 1, dtype=torch.long, device=device)  # `_verify`'s
        self.scored_lineage = shape.tree.scored_lineage(shape.masks, device) if shape.verify else None
        self._processor_buffers(model, shape, processors, device)
        self.on_offer = torch.ones(shape.batch, shape.masks, dtype=torch.bool, device=device)  # masks offered
        self.one_each = torch.ones(shape.batch, dtype=torch.long, device=device)  # τ >= 1: the tokens a row takes
        self.depths = torch.arange(shape.masks, device=device)
        self.offer_grid = self.depths < torch.arange(shape.masks + 1, device=device)[:, None]  # [k, j]: j of k offered
        self.rates_first, self.unreachable = state.rates[:, 0], torch.tensor(math.inf, device=device)  # for `set_tau`
        self.lookup = lookup_columns(shape.batch, shape.slots, shape.lookup, device) if shape.lookup else None
        self.proposals = None  # speculative sampling: the distribution each draft was drawn from, and the next's
        if shape.verify and shape.sampled and shape.typical is None:
            self.proposals = torch.zeros(shape.batch, len(shape.tree) + 1, self.vocab, device=device)
            self.proposed = self.proposals[:, : shape.masks]  # what `propose` writes; the position after stays 0
        self.scoring, self.scores = None, None  # `record_scores`' count of alternatives, and its buffers
        self.kv = self.graph = None
        self.bind(kv)
        self.leased = False  # lent to one caller (`graph_pass_for`)
        self.move_to(0)

    def bind(self, kv) -> None:
        """Decode on `kv`, a run's own static cache of this shape: each pass writes its K/V there, so nothing is
        copied in or out and the K/V are held once. A CUDA graph records the addresses of the cache it was captured
        on, so another cache means another capture (after the warm-up passes)."""
        if kv is self.kv:
            return
        self.kv, self.stacked = kv, stacked_layers(kv)
        # each layer's count of the slots written, where it places each write after the last (else the pass says where)
        self.lengths = [layer.cumulative_length for layer in kv.layers] if counts_static_writes(kv) else []
        self.reach = None
        self.attend(self.shape.slots)
        # A pass moves these on: its slots by what it keeps (its columns of `visibility` back), the step and each row's
        # pass count (which the mask schedule reads) by one, each layer's write count back over masks
        state = self.state
        masked = self.shape.width > self.shape.kept
        self.counters = [self.slots, self.visibility_at, state.logged, state.passes] + (self.lengths if masked else [])
        self.advance = None
        self.advance_by(self.shape.kept)
        self.graph, self.eager_runs = None, 0

    def record_scores(self, top: int | None) -> None:
        """From the next pass, record each token a pass decides: its log probability and the `top` likeliest at the
        slot that decided it (`scoring.token_logprobs`, as a prompt's), into `scores`, `(batch, tokens)` and `(batch,
        tokens, top)` twice (None where `top` is 0); None: record nothing (a pass's cost). A captured pass records as
        it was captured."""
        if top == self.scoring:
            return
        if self.graph is not None:
            raise ValueError("A captured pass records log probabilities as it was captured: build another.")
        self.scoring, self.scores = top, None
        if top is not None:
            shape, device = (self.shape.batch, self.shape.tokens), self.state.done.device
            values = torch.zeros(*shape, top, device=device) if top else None
            ids = torch.zeros(*shape, top, dtype=torch.long, device=device) if top else None
            self.scores = (torch.zeros(shape, device=device), values, ids)

    def advance_by(self, kept: int) -> None:
        """Let the passes to come move their slots on by `kept`: a whole pass by the slots it commits (`shape.kept`),
        a pruned one by the root's and the drafts it fed alone (`prune`), so that the cache fills no faster than the
        pass feeds it. Each layer's count of written slots steps back to that slot, over what the pass wrote after."""
        if kept == self.advance:
            return
        self.advance, width = kept, self.shape.width
        layers = [kept - width] * len(self.lengths) if width > self.shape.kept else []
        self.counter_steps = [kept, -kept, 1, 1] + layers

    def unbind(self) -> None:
        """Let go of the run's cache once it has decoded: a pass kept for later calls holds no K/V, except a captured
        one, whose graph writes that cache's addresses: it keeps it, and the cache is lent to the next call of its
        size (`lend_cache`), whose pass then replays the same graph. An eager pass lets go of its logits' buffer too
        (as large as a pass's logits), made again by the next call that needs it."""
        if self.graph is not None:
            return
        self.kv = self.stacked = self.lengths = self.attended = self.logits_buffer = None
        self.rows_view = self.gathered = None
        self.counters, self.counter_steps = [], []

    def reach_for(self, end: int) -> int:
        """The reach (`attend`) of passes that write up to slot `end`: that, rounded up to `REACH_STEP`."""
        return min(self.shape.slots, -(-end // REACH_STEP) * REACH_STEP)

    def attend(self, reach: int) -> None:
        """Let the passes to come attend to the cache's first `reach` slots only (eager passes, on a cache far wider
        than the rows' texts: a server's slots, a long budget's), until the reach moves: the cache's layers, the slot
        map and `visibility`' columns as views that long, made here once. The passes must write before `reach`."""
        if reach == self.reach:
            return
        self.reach, kv = reach, self.kv
        if reach == self.shape.slots:  # the views made once (`_views`)
            self.attended, self.real_reach, self.real_keys, self.reach_columns = kv, *self.whole
            return
        self.real_reach = self.state.real[:, :reach]
        self.real_keys, self.reach_columns = self.real_reach[:, None, None, :], self.visibility_at[:reach]
        self.attended = cache_view(kv, slice(reach), stacked=self.stacked)

    def feed_held(self) -> None:
        """Before an eager pass on a CPU (`NARROWS`), where a pass costs its compute: feed the rows from the first to
        the last that still decodes or holds a token to cache (`take_rows`), and the masks that the rows' schedule
        offers them (`masks_to_feed`); in τ-mode skip the pending columns that are holes in every row still
        decoding (`narrow`), in lossless mode the tree's nodes no such row drafts (`prune`). A few reads of the
        device, which a CPU does not wait for. Elsewhere the whole pass."""
        shape, state = self.shape, self.state
        lead, nodes, masks = 0, tuple(range(len(shape.tree))), shape.masks
        cuts = self.cuts
        if self.nodes_drafted is not None:  # drafts of the nodes a runner's tree leaves out are none
            self.drafts_real.logical_and_(self.nodes_drafted)
        if cuts:
            masks = self.masks_to_feed()
            if shape.verify:
                nodes = tuple((self.drafts_real & ~state.done[:, None]).any(dim=0).nonzero().flatten().tolist())
            elif shape.pending > 1:
                held = int((self.pending_real & self.live_column).sum(dim=1).max())
                lead = shape.pending - max(held, 1)
        self.masks_fed, self.nodes_fed = masks, len(nodes)
        self.narrow(lead, 0 if shape.verify else shape.masks - masks)
        self.prune(nodes, masks if shape.verify else shape.masks)
        self.take_rows(self._rows_in_use() if cuts else None)

    @property
    def cuts(self) -> bool:
        """Whether the next pass is cut to what its rows use (`feed_held`): eager, on a CPU, `NARROWS` on."""
        return self.narrows and NARROWS

    def masks_to_feed(self) -> int:
        """Masks per group that the next pass needs: none at τ >= 1 (no mask proposes there), else every one, or
        under a schedule the cheapest count covering the largest offer of a row still decoding
        (`schedule.masks_covering`: a row ignores those past its own offer)."""
        shape, state = self.shape, self.state
        if self.tau >= 1.0 or not shape.masks:
            return 0
        if not shape.scheduled:
            return self.masks_limit
        return masks_covering(offers(state.rates, state.time)[~state.done], state.time)

    def _rows_in_use(self) -> slice | torch.Tensor | None:
        """The rows the next pass feeds (`take_rows`), its columns cut already (`narrow`, `prune`): from the first to
        the last that decodes or holds a token to cache, or those rows alone where the rows between them that do
        neither cost more to compute than copying those rows' K/V out and back (`FLOPS_PER_BYTE_COPIED`). The rows
        between cost nothing while the pass, them included, feeds no more columns than a pass that reads the weights
        takes the time of (`bound_columns`: a few rows of one token each)."""
        state = self.state
        width = len(self.pruned[0]) if self.pruned is not None else self.shape.width - self.lead - self.tail
        busy = (~state.done | state.fed_real[:, : self.shape.kept].any(dim=1)).nonzero().flatten()
        if not busy.numel():
            return None
        first, last = int(busy[0]), int(busy[-1]) + 1
        idle = last - first - busy.numel()
        copied = 2 * busy.numel() * self.reach * self.stacked[:, 0, :, 0].nbytes if self.stacked is not None else 0
        bound = self.bound_columns
        saved = (max((last - first) * width, bound) - max(busy.numel() * width, bound)) * self.flops_per_column
        if idle and copied and saved > FLOPS_PER_BYTE_COPIED * copied:
            return busy
        return slice(first, last)

    def take_rows(self, rows: slice | torch.Tensor | None) -> None:
        """Let the next pass compute `rows` of the batch alone (None: every row): adjacent rows (a slice) through a
        view of the cache, else (their indices) through a copy of their K/V that the pass puts back (`_forward`). The
        rows left out decode nothing and hold no real token still to cache (done, or free in a runner): their logits
        are the stale numbers of a buffer laid out as the whole pass's, which `cut` takes nothing of, and their cache
        slots are left as they were."""
        if isinstance(rows, slice) and (rows.start, rows.stop) == (0, self.shape.batch):
            rows = None
        self.fed_rows, self.gathered = rows, None
        if isinstance(rows, torch.Tensor):
            view, self.gathered = gathered_cache(self.kv, self.reach, rows, self.stacked)
            self.rows_view = (None, view)
            return
        key = None if rows is None else (rows.start, rows.stop, self.attended)  # a new reach or cache: a new view
        if key is not None and (self.rows_view is None or self.rows_view[0] != key):
            self.rows_view = (key, cache_view(self.kv, slice(self.reach), rows, self.stacked))

    def free(self, rows: torch.Tensor) -> None:
        """Rows that decode nothing from the next pass on and feed nothing real: a runner's rows let go, whose last
        tokens need no caching."""
        self.state.done.index_fill_(0, rows, True)
        self.live.index_fill_(0, rows, False)
        self.state.fed_real[:, : self.shape.kept].index_fill_(0, rows, False)

    def move_rows(self, sources: torch.Tensor, targets: torch.Tensor, slots: int) -> None:
        """Rows `sources` into rows `targets` between passes (a runner condensing its rows: `Runner._condense`): their
        K/V in the first `slots` slots, their text and counters, what the next pass feeds them, their mask schedule,
        and what the processors keep of their histories; `sources` are free afterwards. The tables stay (a row's are
        its place's). K/V is copied from the first slot any of them holds: a row that joined late ends its prompt
        just before the slot it joined at (holes before, left out of the copy), and the rows moved are the last
        held, mostly the latest to join."""
        state = self.state
        first = int(state.real[sources, :slots].any(dim=0).float().argmax())  # a held row holds a slot
        rows = [state.text, state.write_offsets, state.budget, state.decoded, state.text_end, state.text_last]
        rows += [state.done, state.real, state.last_position, state.fed, state.fed_real, state.rates, state.last]
        rows += [state.passes, self.live, self.on_offer, self.targets, *self.seen_tokens]
        rows += [t for t in (self.spare_text, self.proposals) if t is not None]
        for tensor in rows:
            tensor.index_copy_(0, targets, tensor.index_select(0, sources))
        state.accepted_log.index_copy_(1, targets, state.accepted_log.index_select(1, sources))
        self.free(sources)
        pairs = list(zip(sources.tolist(), targets.tolist()))  # a row's K/V slice copied as one strided view: an
        if self.stacked is not None:  # `index_copy_` into a view of the whole cache walks far more than it copies
            for source, target in pairs:
                self.stacked[:, target, :, first:slots].copy_(self.stacked[:, source, :, first:slots])
            return
        for layer in self.kv.layers:
            for tensor, (source, target) in itertools.product((layer.keys, layer.values), pairs):
                tensor[target, :, first:slots].copy_(tensor[source, :, first:slots])

    def narrow(self, lead: int, tail: int = 0) -> None:
        """Let the next τ-mode pass skip its first `lead` columns, pending slots that are holes in every row still
        decoding (τ-mode right-aligns the tokens a row took last, up to B), and its last `tail`, masks no such row uses
        (`masks_to_feed`): it feeds the rest. Its first fed column lands on the slot the pass would have written first
        (its slots and `visibility`' columns start `lead` back), so the passes move on by the slots they fed, not by
        B: the next starts after this one's last pending column. Eager passes only: the views are kept, one set per
        cut."""
        if (lead, tail) not in self.leads:
            fed, relative, visibility, slots = self.leads[0, 0]
            end = self.shape.width - tail
            self.leads[lead, tail] = (
                fed[:, lead:end],
                relative[lead:end],
                visibility[:, :, lead:end],
                slots[lead:end],
            )
            self.marks[lead] = (self.slots[lead:], self.state.fed_real[:, lead:])  # the slots it marks real or not
        self.lead, self.tail = lead, tail
        if lead:
            torch._foreach_add_([self.slots, self.visibility_at], [-lead, lead])

    def prune(self, nodes: tuple[int, ...], masks: int) -> None:
        """Let the next lossless pass feed the tree's drafts `nodes` alone (indices, in order), no row still decoding
        having drafted the others, and `masks` masks per group (`masks_to_feed`): the root, those drafts and the groups
        after each, written to consecutive slots from the pass's first. The drafts' slots follow the root's in node
        order (`_commit` keeps or leaves each as a hole: `order`), and the groups after them. Its logits go into a
        buffer laid out as the whole pass's, where the columns left out keep numbers nothing reads. The passes move on
        by the root's and those drafts' slots alone (`advance_by`): the next writes over the groups. Eager passes only:
        the tables kept per cut (a few dozen at most)."""
        shape = self.shape
        self.advance_by(shape.pending + len(nodes))
        if (len(nodes), masks) == (len(shape.tree), shape.masks):
            self.pruned = None
            return
        if (nodes, masks) not in self.prunes:
            if len(self.prunes) >= PRUNES_KEPT:
                self.prunes.clear()
            columns = _node_columns(shape, nodes, masks)
            visible = shape.tree.visibility(shape.pending, shape.masks)[columns][:, columns]
            visibility = _visibility(visible, shape.slots, self.blocked.cpu()).to(self.blocked.device)
            columns = columns.to(self.slots.device)
            order = None  # the node each draft slot holds, where the nodes fed are not the tree's first ones
            if nodes != tuple(range(len(nodes))):
                order = torch.tensor(nodes + tuple(n for n in range(len(shape.tree)) if n not in nodes))
                order = order.to(self.slots.device)
            self.prunes[nodes, masks] = (
                columns,
                self.relative[columns],
                visibility,
                self.slots[: columns.numel()],
                order,
            )
        self.pruned = self.prunes[nodes, masks]

    def use_processors(self, processors) -> None:
        """Apply `processors` from the next pass: an eager pass's rows taking up a grammar or dropping it between
        passes (`Runner.use_processors`). The shape says what they are; what they keep of the rows' histories is found
        from the text. A compiled pass applies those it was compiled with."""
        if not self.eager:
            raise ValueError("A compiled pass applies the logits processors it was compiled with.")
        self.shape = replace(self.shape, **processor_fields(processors))
        self._processor_buffers(self.model, self.shape, processors, self.state.done.device)
        self.find_held()

    def _processor_buffers(self, model, shape: GraphShape, processors, device) -> None:
        """What the logits processors read that a pass keeps, rather than finding it anew every pass (`processors`:
        the run's, `scoring.order_free` or `by_rules`): per repetition penalty, `(batch, vocab + 1)`, the tokens each
        row's history holds (`Histories.seen`), found when rows are loaded (`find_held`), then added to by each pass
        (`_commit`); for τ-mode's n-gram bans, a copy of the text with the spare id past each history
        (`Histories.spare_text`) and its windows, found when rows are loaded, then written by each pass (its slots'
        tokens, the spare id where a row took none); for τ-mode's slots sampled one by one, their random numbers'
        buffer (`scoring.kept_noise`)."""
        self.processors = processors
        self.ids = {}  # `Histories.no_ids`' columns, made once
        penalties = [p for p in processors or () if isinstance(p, SET_BASED)]
        bans = not shape.verify and any(isinstance(p, NGRAM_BANS) for p in processors or ())
        drawn_in_order = not shape.verify and shape.sampled and shape.reads_text
        sampled_drafts = shape.verify and shape.sampled and shape.typical is None  # `proposals`
        needs_vocab = penalties or sampled_drafts or bans or drawn_in_order
        self.vocab = model.get_output_embeddings().weight.shape[0] if needs_vocab else None
        self.seen_tokens = [
            torch.zeros(shape.batch, self.vocab + 1, dtype=torch.bool, device=device) for _ in penalties
        ]
        self.spare_text = torch.zeros_like(self.state.sequences) if bans else None
        self.ngrams = self.histories(found=False).ngram_windows(self.vocab, self.spare_text) if bans else None
        self.noise = kept_noise(shape.masks + 1, shape.batch, self.vocab, device) if drawn_in_order else None

    def _views(self, shape: GraphShape, state: GraphState) -> None:
        """Views of the state's buffers that a pass reads or writes, made once (a view made in a pass is an op)."""
        pending, drafts = slice(0, shape.pending), slice(shape.pending, shape.kept)
        self.pending, self.drafts = state.fed[:, pending], state.fed[:, drafts]
        self.pending_real, self.drafts_real = state.fed_real[:, pending], state.fed_real[:, drafts]
        self.live = torch.zeros_like(state.done)  # rows not done when the last pass ended
        self.live_column = self.live[:, None]
        self.slots = torch.zeros(shape.width, dtype=torch.long, device=state.fed.device)  # this pass's cache slots
        self.draft_slots = self.slots[shape.pending : shape.kept]
        self.decoded_column, self.last_column = state.decoded[:, None], state.last_position[:, None]
        self.text_start, self.text_last_column = state.write_offsets[:, 0], state.text_last[:, None]
        self.rows = torch.arange(shape.batch, device=state.fed.device)[:, None]
        split = shape.kept - shape.lookup  # where lookup's drafts start
        masks, looked_up = slice(shape.pending, split), slice(split, shape.kept)
        self.from_masks, self.from_masks_real = state.fed[:, masks], state.fed_real[:, masks]  # the drafts, by source
        self.from_lookup, self.from_lookup_real = state.fed[:, looked_up], state.fed_real[:, looked_up]

    def move_to(self, slot: int) -> None:
        """The next pass writes the cache from `slot` on (a run's first pass here, after compaction, after a row
        joins): its slots, and the column of `visibility` each key slot reads. Each pass then moves them itself."""
        torch.add(self.pass_slots, slot, out=self.slots)
        torch.sub(self.key_columns, slot, out=self.visibility_at)

    def set_tau(self, tau: float) -> None:
        """τ for the passes to come, as the state holds it: inf at τ >= 1 (a pass then accepts or proposes nothing past
        slot 0, even a probability rounded to 1), where the schedule's rates start (at τ >= 1 from 0, so that every
        offer is worth nothing and the first, no mask, is made: `schedule.offers`), and the τ each offer sets each
        mask's token (inf past the offer), which τ-mode reads with one index a pass."""
        state, self.tau = self.state, tau
        state.tau.fill_(tau if tau < 1.0 else math.inf)
        if self.shape.scheduled:
            self.rates_first.fill_(float(tau < 1.0))
            torch.where(self.offer_grid, state.tau, self.unreachable, out=state.limits)

    def histories(self, found: bool = True) -> Histories:
        """What the logits processors read: every row's text as it stands, each history to its decoded tokens, the
        tokens each holds those of `held` and n-gram bans' windows over `spare_text` (unless not `found`: then found
        from the text)."""
        held, ngrams = (self.seen_tokens or None, self.ngrams) if found else (None, None)
        text, ends = self.state.sequences, self.state.text_end
        rows = self.rows[:, 0] if self.shape.calls else None  # transformers' processors: every row's text, by length
        return Histories(self.processors, text, rows, ends, ids=self.ids, seen=held, ngrams=ngrams)

    def find_held(self) -> None:
        """`held` and `spare_text` found anew from every row's text, once rows are loaded (`runner.load_rows`)."""
        fresh = self.histories(found=False)
        if self.seen_tokens:
            torch._foreach_copy_(self.seen_tokens, fresh.seen(self.vocab))
        if self.spare_text is not None:
            self.spare_text.copy_(fresh.spare_text(self.vocab))

    def compact(self, slot: int) -> int:
        """Squeeze the holes out of this pass's cache between two passes (`compact_static`): the slot the next pass
        writes. Slots from `slot` on held the last pass's masks, which the next pass writes again: nothing real."""
        self.state.real[:, slot:].fill_(False)
        if not self.cuts:  # one gather of fixed shape (a captured pass's cache; on a GPU, a launch whatever its size)
            used = int(compact_static(self.kv, self.state.real, self.stacked))
        else:  # on a CPU, where a copy costs its bytes: the rows and slots in use alone
            holding = self.state.real[:, :slot].any(dim=1).nonzero().flatten().tolist() or [0]
            rows = slice(holding[0], holding[-1] + 1)
            used = int(compact_static(self.kv, self.state.real, self.stacked, rows, slot))
        self.move_to(used)
        return used

    def run(self) -> None:
        """One pass: the graph replayed, else (before capture, or off CUDA) the pass itself."""
        if self.graph is not None:
            self.graph.replay()
        elif self.capture and self.eager_runs >= WARMUP_PASSES:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):  # records the pass; nothing runs until `replay`
                self.pass_function(self)
            self.graph.replay()
        elif self.capture:  # warm-up passes run on a side stream, as CUDA graph capture requires
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.pass_function(self)
            torch.cuda.current_stream().wait_stream(stream)
            self.eager_runs += 1
        else:
            self.pass_function(self)


def _tables(shape: GraphShape, dtype) -> dict:
    """The constants a pass indexes (see `GraphPass`), on the host."""
    width, slots = shape.width, shape.slots
    blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype)
    tables = dict(
        visibility=_visibility(shape.tree.visibility(shape.pending, shape.masks), slots, blocked),
        key_columns=torch.arange(slots) + slots,
        pass_slots=torch.arange(width),
        relative=_relative_positions(shape),
        offsets=torch.arange(shape.tokens),
        untaken=torch.arange(shape.tokens) >= torch.arange(shape.tokens + 1)[:, None],  # by tokens taken: the rest
        blocked=blocked,  # the additive mask's value where a query sees nothing
    )
    if shape.scheduled:
        tables.update(moves=rate_moves(shape.masks))
    if shape.verify:
        tables.update(_tree_tables(shape))
    else:  # the first `count` of a pass's tokens right-aligned as the next pending ones, for each count
        counts = torch.arange(shape.pending + 1)
        columns = torch.arange(shape.pending).expand(len(counts), -1)
        tables.update(zip(("align", "align_real"), right_align(columns, counts, shape.pending, 0)))
    return tables


def _visibility(visible: torch.Tensor, slots: int, blocked: torch.Tensor) -> torch.Tensor:
    """`(1, 1, fed, 2 * slots)` additive mask values by key slot - pass slot + `slots`: before the pass every real slot
    is seen, within it what `visible` (fed x fed) allows, nothing after it."""
    fed = visible.shape[0]
    before, after = torch.ones(fed, slots, dtype=torch.bool), torch.zeros(fed, slots - fed, dtype=torch.bool)
    return torch.where(torch.cat([before, visible, after], 1), torch.zeros_like(blocked), blocked)[None, None]


def _node_columns(shape: GraphShape, nodes: tuple[int, ...], masks: int) -> torch.Tensor:
    """The columns of a lossless pass that feeds the tree's drafts `nodes` alone and `masks` masks per group: the root,
    those drafts, and the first masks of the groups after the root and each of them (the groups lie in node order)."""
    groups = torch.tensor((0,) + tuple(node + 1 for node in nodes), dtype=torch.long)
    fed_drafts = torch.cat([torch.arange(shape.pending), shape.pending + groups[1:] - 1])
    groups = shape.kept + shape.masks * groups[:, None] + torch.arange(masks)
    return torch.cat([fed_drafts, groups.flatten()])


def _tree_tables(shape: GraphShape) -> dict:
    """Lossless mode's table over the tree's nodes `[root, drafts]`, as a pass's logits are laid out, besides the
    tree's own (`DraftTree.on`: each node's lineage and path): the logits of the masks that follow each node."""
    nodes = len(shape.tree) + 1
    return dict(group=nodes + torch.arange(nodes)[:, None] * shape.masks + torch.arange(shape.masks))


def _relative_positions(shape: GraphShape) -> torch.Tensor:
    """`(width,)`: each fed token's position past the last pending slot's, were every pending slot real: a prompt's
    pass's positions (`cache.pass_positions`) of a row whose pending tokens end at position 0."""
    fed = torch.ones(1, shape.pending + len(shape.tree), dtype=torch.bool)
    return pass_positions(torch.zeros(1, dtype=torch.long), fed, shape.masks, shape.tree)[0] - (shape.pending - 1)


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
    if not shape.verify:  # right-aligned pending tokens: the holes on the left would count back past 0
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


def _compiled(function, config, mode=None):
    """`function` compiled with `generate()`'s `CompileConfig` (its backend; inductor's `mode` if given, which here
    means no CUDA graphs of its own), once per function and config, allowed `RECOMPILE_LIMIT` shapes. Inductor draws
    random numbers with eager's generator (`fallback_random`): its own draw others, so a seed would not give the
    eager pass's (and at τ = 1 `generate()`'s) tokens."""
    mode = mode or config.mode
    key = (function, config.backend, mode)
    if key not in _COMPILED:
        options = None
        if config.backend == "inductor":  # the mode's options (torch.compile takes a mode or options, not both)
            from torch._inductor import list_mode_options  # loaded where a pass compiles, not on import

            options = {**(list_mode_options(mode) if mode else {}), "fallback_random": True}
        compiled = torch.compile(function, backend=config.backend, options=options, dynamic=False)
        _COMPILED[key] = many_shapes(compiled)
    return _COMPILED[key]


_COMPILED: dict = {}


class _Graphs(dict):
    """A model's graph passes, by shape, and `spares`: more of a shape, built for calls that found it lent (threads
    decoding at once); also the static caches kept for later calls (`keep_cache`). A copy of the model
    (`copy.deepcopy`) starts with none and builds its own."""

    def __init__(self):
        super().__init__()
        self.spares: dict = {}

    def lend(self, key) -> GraphPass | None:
        """A pass of this shape that no call holds, now held; None where every one is."""
        for g in ([self[key]] if key in self else []) + self.spares.get(key, []):
            if not g.leased:
                g.leased = True
                return g
        return None

    def keep(self, key, g: GraphPass) -> None:
        """Keep a pass built for `key`: as the shape's first (past `GRAPHS_KEPT` shapes, every pass kept goes first),
        or as a spare."""
        if key not in self:
            if len(self) >= GRAPHS_KEPT:
                self.clear()
                self.spares.clear()
            self[key] = g
        elif len(self.spares.setdefault(key, [])) < SPARES_KEPT:
            self.spares[key].append(g)

    def __deepcopy__(self, memo):
        return _Graphs()


_LEASES = threading.Lock()  # guards every model's `_mars_graphs` and `_mars_caches`, and each pass's `leased` flag


def captured(device, compiled: bool) -> bool:
    """Whether a pass on `device` is captured as a CUDA graph: under the compile path (`compiled`) on CUDA. A captured
    pass writes the addresses it was captured on, so there a run's static cache outlives the run, lent to the next
    call that fits in it (`lend_cache`), rather than a capture per call. Elsewhere a call's cache is its own, and
    nothing of it stays once the call returns."""
    return compiled and torch.device(device).type == "cuda"


def lend_cache(model, key, slots: int):
    """The smallest static cache of at least `slots` slots kept on the model for `key` (its rows, dtype and device)
    that no call holds, emptied and now held; None where there is none. A larger one serves: the run's pass then has
    its shape, whose graph was captured on it, as transformers' own reused cache only ever grew."""
    with _LEASES:
        free = model.__dict__.setdefault("_mars_caches", _Graphs()).setdefault(key, [])
        fits = [kv for kv in free if static_cache_size(kv) >= slots]
        kv = min(fits, key=static_cache_size) if fits else None
        if kv is not None:
            free.remove(kv)
    if kv is not None:
        kv.reset()
    return kv


def keep_cache(model, key, kv) -> None:
    """Keep a run's static cache for later calls of `key`: at most `SPARES_KEPT` + 1 a key, the smallest let go."""
    with _LEASES:
        free = model.__dict__.setdefault("_mars_caches", _Graphs()).setdefault(key, [])
        free.append(kv)
        if len(free) > SPARES_KEPT + 1:
            free.remove(min(free, key=static_cache_size))


@contextmanager
def graph_pass_for(model, kv, shape: GraphShape, compile_config=None, processors=None):
    """A `GraphPass` of this shape decoding on `kv` (the run's own static cache), held by this caller alone until the
    block ends. Passes are kept on the model without their K/V, and lent where one is free, so that calls reuse their
    tables and buffers; a caller that finds every one lent (threads decoding the same shape at once) builds another,
    kept as a spare, so that concurrent generations on one model never share a pass's state."""
    graphs = model.__dict__.setdefault("_mars_graphs", _Graphs())
    compiling = None if compile_config is None else (compile_config.backend, compile_config.mode)
    key = (shape, compiling, FUSED, model.dtype, str(kv.layers[0].keys.device))
    with _LEASES:
        g = graphs.lend(key)
    if g is None:
        g = GraphPass(model, kv, shape, compile_config, processors)
        g.leased = True
        with _LEASES:
            graphs.keep(key, g)
    try:
        g.bind(kv)
        yield g
    finally:
        g.unbind()
        with _LEASES:
            g.leased = False
