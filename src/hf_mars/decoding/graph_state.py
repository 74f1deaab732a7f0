"""A graph pass's shape, the rows' state it reads and writes, and the object that runs it.

`GraphShape` is everything Python decides about a pass (passes of equal shape share one); `GraphState` the tensors a
pass reads and writes in place, for every row, keeping their shapes and addresses from pass to pass; `GraphPass` one
shape's pass: that state, the tables a pass reads with one index each (built here once), the buffers of its logits
processors, what an eager pass on a CPU leaves out (idle rows, unused columns, untaken tree nodes), and the pass
itself (`graph.graph_pass`), run eagerly, compiled, or captured as a CUDA graph. `graph_pass_for` lends a model's
passes to one caller at a time, kept without their K/V; `lend_cache`/`keep_cache` do the same for the static caches
a captured pass writes.

This file is copied into MARS checkpoints (trust_remote_code).
"""

from __future__ import annotations

import itertools
import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from .cache import cache_view, compact_static, gathered_cache, pass_positions, stacked_layers
from .commit import right_align
from .compat import counts_static_writes, many_shapes, static_cache_size
from .graph import graph_pass
from .schedule import masks_covering, offers, rate_moves
from .scoring import (
    NGRAM_BANS,
    SET_BASED,
    Histories,
    by_rules,
    history_free,
    kept_noise,
    processors_signature,
)
from .tree import DraftTree, lookup_columns

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
        # what attention reads of them
        self.whole = (state.real, state.real[:, None, None, :], self.visibility_at)
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
        tokens each holds those of `seen_tokens` and n-gram bans' windows over `spare_text` (unless not `found`: then
        found from the text)."""
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
