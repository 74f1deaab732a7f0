"""The runner: a fixed number of rows decoding in one graph pass over one static cache, rows joining and leaving.

A `Runner` holds `capacity` rows, each free or held by a label, over one `GraphPass` (`graph.py`) and the static
cache it decodes on. `admit` gives a prepared session's rows (`model.mars_rows`, or `generate()`'s batch) their
prompt's pass straight into free rows: the pass writes the prompt's K/V into those rows' slots of the runner's own
cache (a view of its rows, no copy), and what each row decodes next goes into the pass's state. `step` runs one pass
for every row (a free row is a done one, and decodes nothing), `rows` reads every held row's tokens, `release` frees
rows the moment they stop. `generate()` admits its whole batch once and steps until every row is done; a server
admits requests between passes.

Every row writes the slot the next pass writes; a row that joins ends its prompt just before it (holes before), and
the cache is compacted when a pass would not fit, between two passes. Rows that join together take adjacent free
rows, since their prompt's pass writes a view of them: `room` says how many can.

This file is copied into MARS checkpoints (trust_remote_code).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from .cache import StaticMARSCache, allocate_layers, cache_view
from .compat import full_attention_config, static_cache_size
from .graph_state import GraphPass, GraphShape, processor_fields
from .scoring import follow_padding, processors_signature
from .session import draft_shape
from .settings import read_tau
from .tree import NO_DRAFTS, DraftTree, canonical_candidates, depth_candidates, full_tree


def _in_own_mode(verb):
    """Run a runner's verb in the grad mode its tensors were made in (inference mode or not; never recording autograd),
    whatever its caller's: a tensor made in inference mode cannot be written in place outside it."""

    @functools.wraps(verb)
    def in_mode(self, *args, **kwargs):
        with torch.inference_mode(self.inference), torch.no_grad():  # (inference_mode(False) turns grad on)
            return verb(self, *args, **kwargs)

    return in_mode


class Runner:
    """Rows decoding in `graph`, a `GraphPass` over a static cache of `graph.shape.batch` rows, with `plan`'s
    settings (`session.Plan`): `admit`, `step`, `rows`, `release`. `log`: record every pass (`record`: the first
    rows' prompt's pass, then each pass's τ, masks and accepted tokens, as `generate()` reports them), else keep only
    the last pass's accepted tokens (a server's). `logprobs`, as a `Session`'s: where set (a count of alternatives, 0
    or more), each pass leaves in `scored` the log probability of every token it decided and the likeliest at each
    slot, `(places, logprobs (rows, tokens), top values, top ids)`, a held row's at its place in `rows()`."""

    def __init__(self, plan, graph: GraphPass, log: bool = False, tree_plan=None):
        """`tree_plan`: the plan `graph`'s tree was built for, where it is wider than `plan`'s (`serving_runner`'s
        `trees`): the rows then draft the nodes of `plan`'s tree alone, until `retree` chooses another."""
        self.plan, self.graph, self.shape, self.log = plan, graph, graph.shape, log
        self.tree_plan = tree_plan or plan
        self.widened = self.tree_plan is not plan  # built for other trees too: it may re-choose among them
        state, capacity = graph.state, graph.shape.batch
        state.done.fill_(True)  # every row free
        state.sequences.fill_(plan.pad_token_id)
        state.write_offsets.copy_(graph.offsets + 1)  # a free row's text: one pad (processors read it)
        state.logged.zero_()
        graph.eos.copy_(plan.eos)
        graph.move_to(0)
        long = dict(dtype=torch.long, device=state.done.device)
        self.lead = torch.zeros(capacity, **long)  # the left padding each row's text keeps
        self.passes = torch.zeros(capacity, **long)  # the passes each row took part in
        self.row_labels: list = [None] * capacity  # each row's label, None where free
        self.slot, self.tau, self.unread_passes = 0, None, 0
        self.stats, self.passes_run, self.logged = None, 0, 0  # `record`'s
        self.inference = torch.is_inference_mode_enabled()  # the mode its verbs run in (`_in_own_mode`)
        self.scored = None
        self.condenses = True  # released rows' places are taken by the last held rows, where a pass cuts (`release`)
        graph.record_scores(None)  # a pass lent again (`graph_pass_for`) records what this runner asks
        if self.widened:
            self.retree(plan.settings)

    @property
    def labels(self) -> list:
        return [label for label in self.row_labels if label is not None]

    @property
    def live(self) -> bool:
        return bool(self.labels)

    @property
    def decoding(self) -> int:
        """Rows held (a row is freed the moment it stops)."""
        return len(self.labels)

    @property
    def room(self) -> int:
        """The most rows that can join at once: the longest run of adjacent free rows."""
        longest = adjacent = 0
        for label in self.row_labels:
            adjacent = adjacent + 1 if label is None else 0
            longest = max(longest, adjacent)
        return longest

    @property
    def logprobs(self) -> int | None:
        """The alternatives each pass records beside its tokens' log probabilities (None: none recorded)."""
        return self.graph.scoring

    @logprobs.setter
    @_in_own_mode
    def logprobs(self, top: int | None) -> None:
        self.graph.record_scores(top)

    @property
    def retrees(self) -> bool:
        """Whether the rows' draft tree may change between passes (`retree`): an eager lossless runner built for
        several trees (`serving_runner`'s `trees`), whose passes feed the nodes its rows draft (a compiled pass keeps
        its tree's shape, and so its cost)."""
        return self.graph.eager and self.shape.verify and self.widened

    @_in_own_mode
    def retree(self, settings) -> None:
        """Decode on with `settings`, another lossless draft tree within the runner's (`tree_plan`'s), or none (τ = 1,
        plain decoding, as `model.mars_rows` makes plain settings), from the next pass: a server re-chooses the
        tree that pays at the rows it runs now. Lossless mode's text does not depend on the tree; the drafts of nodes
        left out are dropped, and the next pass proposes the new tree's."""
        if not self.retrees and settings != self.plan.settings:
            raise ValueError("A compiled runner keeps its draft tree: its passes have the tree's shape.")
        if not settings.any_tree:
            raise ValueError("Only lossless mode (or τ = 1, its plain form) changes its draft tree between passes.")
        plan, g, widest = self.plan, self.graph, self.tree_plan.settings
        if replace(settings, **_tree_settings(widest)) != widest:
            raise ValueError("The rows may change their draft tree alone, within the runner's, not their settings.")
        masks = settings.block_size - 1 if settings.verify else self.shape.masks
        if masks < self.shape.masks and self.shape.scheduled:
            raise ValueError("Rows with a mask schedule keep their block size.")
        candidates, lookup = draft_shape(settings, plan.do_sample, plan.typical, plan.processors)
        drafted = _tree_nodes(self.shape, settings.verify, masks, candidates, lookup)
        self.plan = replace(plan, settings=settings, candidates=candidates, lookup=lookup)
        g.nodes_drafted = None if bool(drafted.all()) else drafted.to(g.state.done.device)
        g.masks_limit = masks
        if not self.shape.scheduled:  # the masks a pass's drafts are proposed from
            g.on_offer.copy_((g.depths < masks).expand_as(g.on_offer))

    @_in_own_mode
    def use_processors(self, processors) -> None:
        """Decode with `processors` from the next pass (an eager runner: a server's rows taking up a grammar, or
        dropping it once no row follows one), lossless drafts re-chosen for them (a chain where they read the text:
        `draft_shape`), as a `Session`'s plan is replaced between passes."""
        self.graph.use_processors(processors)
        self.shape = self.graph.shape
        self.plan = replace(self.plan, processors=processors)
        self.tree_plan = replace(self.tree_plan, processors=processors) if self.widened else self.plan
        if self.plan.settings.any_tree:
            try:
                self.retree(self.plan.settings)
            except ValueError:  # a tree wider than the runner's (built for a chain): its own stays, as exact
                pass
        self._follow_padding(int(self.lead.max()) + 1)

    def decodes_like(self, other) -> bool:
        """Whether `other`'s rows decode with these settings, sampling and processors, stop at the same EOS tokens, and
        make the same graph pass (`graph_shape`: the pad id, windows, tree and schedule too)."""
        mine, theirs = self.plan, other.plan
        settings = theirs.settings
        if self.retrees and settings.any_tree and mine.settings.any_tree:  # they draft the runner's tree here
            settings = replace(settings, **_tree_settings(mine.settings))
        same = (settings, theirs.do_sample, theirs.typical) == (mine.settings, mine.do_sample, mine.typical)
        processed = len({processors_signature(p.processors, layout=False) for p in (mine, theirs)}) == 1
        if not (same and processed and torch.equal(theirs.eos, mine.eos)):
            return False
        tree, compiled = _tree_of(self.tree_plan), not self.graph.eager
        shape = graph_shape(other, self.shape.batch, self.shape.slots, self.shape.tree, compiled, **tree)
        # the processors' row layout (where each text starts) is each row's own; the rest must be equal
        return shape is not None and replace(shape, processors=()) == replace(self.shape, processors=())

    def refusal(self, other) -> str | None:
        """Why `other`'s rows (a prepared session, before its prompt's pass) cannot join (None: they can)."""
        if other.stats.forward_passes:
            return "rows join before their prompt's pass, which the runner runs (`admit`)"
        if not self.decodes_like(other):
            return "the rows decode with other settings"
        rows = other.text.sequences.shape[0]
        if rows > self.room:
            return f"{rows} rows, {self.room} adjacent free"
        if getattr(other.cache, "kv", None) is self.graph.kv:  # `generate()`'s, which sized the cache for its rows
            return None
        needed = self.slots_needed(other)
        if needed > self.shape.slots:
            return f"a prompt and its max_tokens need {needed} cache slots, more than the {self.shape.slots} served"
        return None

    def slots_needed(self, other) -> int:
        """The cache slots `other`'s rows need here: the longest prompt and budget among them, and a pass."""
        text = other.text
        return max(int((text.prompt_real.sum(dim=1) + text.budget).max()), text.prompt_length) + self.shape.width

    @_in_own_mode
    def admit(self, other) -> None:
        """`other`'s rows (a session prepared with the same settings, before any pass) into adjacent free rows: their
        prompt's pass (`Session.prompt_pass`) writes its K/V straight into those rows of the runner's
        cache, ending just before the slot the next pass writes; then each row's text and what it decodes next go
        into the pass's state. `other` is spent afterwards."""
        reason = self.refusal(other)
        if reason is not None:
            raise ValueError(f"These rows cannot join the runner: {reason}.")
        rows, width = other.text.sequences.shape[0], other.text.prompt_length
        first = self._free_run(rows)
        self._open_slots(width)
        start = self.slot - width
        other.cache = self._rows_cache(other, first, rows, start, min(self.slot + self.shape.width, self.shape.slots))
        other.prompt_pass(self.graph.model)
        for written in self.graph.lengths or []:  # each layer's next write: the runner's slot
            written.fill_(self.slot)
        targets = torch.arange(first, first + rows, device=self.graph.state.done.device)
        self._place(other, targets, start)
        self.row_labels[first : first + rows] = list(other.labels or range(rows))  # `generate()`'s: by index
        if other.logprobs is not None:  # recorded for every row from the next pass, as many alternatives as any asks
            self.logprobs = max(self.logprobs or 0, other.logprobs)
            self.scored = (self._places().index_select(0, targets), *other.scored)  # their prompt's pass's tokens

    def _free_run(self, rows: int) -> int:
        """The first of `rows` adjacent free rows."""
        adjacent = 0
        for index, label in enumerate(self.row_labels):
            adjacent = adjacent + 1 if label is None else 0
            if adjacent == rows:
                return index - rows + 1
        raise ValueError(f"{rows} rows, {self.room} adjacent free")

    def _open_slots(self, width: int) -> None:
        """Make the next pass write at least `width` slots in, with room for a pass after it: a prompt of `width`
        columns ends just before that slot. Holes for the other rows where it moves on; compaction where a pass would
        not fit."""
        g = self.graph
        if not self.live:  # every row free: the cache holds nothing real, and passes start again from its first slot
            g.state.real.fill_(False)
            self.slot = 0
        elif self.slot + self.shape.width > self.shape.slots:
            self._compact()
        if width > self.slot:
            g.state.real[:, self.slot :] = False
            self.slot = width
            g.move_to(width)  # where the pass writes (each layer is set there after the prompt's pass)

    def _rows_cache(self, other, first: int, rows: int, start: int, end: int) -> StaticMARSCache:
        """The cache `other`'s prompt pass writes: rows `first`... of the runner's, slots `start` to `end` (the
        prompt, then its pass's masks). The whole cache where those rows are all of them and the session holds it
        already (`generate()`'s, where the first tokens of a cache passed in may be already); else a view of those
        rows and slots (each layer's keys and values sliced: writes land in the runner's cache), a static cache of its
        own as wide as the pass, whose attention reads no more."""
        kv, mine = self.graph.kv, other.cache
        if isinstance(mine, StaticMARSCache) and mine.kv is kv and rows == self.shape.batch and start == 0:
            for written in self.graph.lengths or []:  # after what it holds (a cache passed in to be continued)
                written.fill_(mine.length)
            return mine
        view = cache_view(kv, slice(start, end), slice(first, first + rows), self.graph.stacked)
        for layer in view.layers if self.graph.lengths else ():  # its own count of written slots, from `start`
            layer.cumulative_length = torch.zeros_like(layer.cumulative_length)
        cache = StaticMARSCache(view, rows, self.graph.state.done.device)
        return cache

    def _place(self, other, targets: torch.Tensor, start: int) -> None:
        """After the prompt's pass: which of the rows' slots are real, their texts (the padding of rows opened with
        them, which is not their own batch's, left out: `Text.joined`), the passes they took part in, and what each
        decodes next (`load_rows`). Nothing read from the device."""
        g, state, text = self.graph, self.graph.state, other.text
        real = other.cache.real  # from slot `start` on
        state.real[targets] = False
        state.real[targets, start : start + real.shape[1]] = real
        width = state.sequences.shape[1]
        source = torch.arange(width, device=targets.device) + text.joined[:, None]  # each row's text, from column 0
        ends = (text.prompt_length + text.decoded)[:, None]
        shifted = text.sequences.gather(1, source.clamp(max=text.sequences.shape[1] - 1))
        state.sequences[targets] = shifted.masked_fill(source >= ends, self.plan.pad_token_id)
        state.write_offsets[targets] = g.offsets + (text.prompt_length - text.joined)[:, None]
        self.lead[targets] = (~text.prompt_real).sum(dim=1) - text.joined  # the padding of its own batch
        self.passes[targets] = text.passes
        self._follow_padding(text.prompt_length + 1)
        load_rows(g, other, targets)
        if self.log and self.stats is None:  # the first rows' stats, their prompt's pass in them, go on here
            self.stats = other.stats

    @_in_own_mode
    def step(self) -> None:
        """One pass for every row (free rows decode nothing): one launch, or one graph replay."""
        g, state = self.graph, self.graph.state
        tau = read_tau(self.plan.settings.tau)
        if tau != self.tau:
            g.set_tau(tau)
            self.tau = tau
        if self.slot + self.shape.width > self.shape.slots:
            self._compact()
        if self.stats is not None and self.passes_run == self.shape.slots:  # the log is full: recorded, then reused
            self.record()
            state.logged.zero_()
            self.passes_run = self.logged = 0
        if g.eager:  # attention over the slots in use, in steps, and no column that is a hole in every row
            self._reach()
            g.feed_held()
        if not self.log:
            state.logged.zero_()  # each pass's accepted counts are read after it, in row 0
        g.run()
        self.slot += g.advance - g.lead  # the slots the pass fed before its masks (`narrow`, `prune`)
        self.unread_passes += 1
        if g.scoring is not None:
            held = self._places().ge(0).nonzero().flatten()
            places = torch.arange(held.numel(), device=held.device)
            self.scored = (places, *(None if t is None else t.index_select(0, held) for t in g.scores))
        if self.stats is not None:
            self.passes_run += 1
            self.stats.forward_passes += 1
            self.stats.tau_per_step.append(self.tau)
            self.stats.masks_per_step.append(g.masks_fed)

    def take_back(self) -> None:
        """Undo the books of the last pass, one that ran idle: queued before the host read that every row was done
        (`generate()`'s passes queued ahead, `_replay_ahead`). It took no token; its slots hold nothing the rows keep,
        and it is no pass of the stats. The device's counters stay moved on: a runner whose rows are all done is
        admitted into again only after it is emptied (`_open_slots`), or built anew."""
        self.slot -= self.graph.advance - self.graph.lead
        self.unread_passes -= 1
        if self.stats is not None:
            self.passes_run -= 1
            self.stats.forward_passes -= 1
            self.stats.tau_per_step.pop()
            self.stats.masks_per_step.pop()

    @_in_own_mode
    def record(self):
        """With `log`: what the passes did (`session.MARSStats`: the first rows' prompt's pass, then every pass here),
        each pass's accepted tokens copied from the device's log when read (not in every pass); else None."""
        if self.stats is not None and self.logged < self.passes_run:
            taken = self.graph.state.accepted_log[self.logged : self.passes_run]
            self.stats.accepted_per_step.extend(taken.clone().unbind(0))
            self.logged = self.passes_run
        return self.stats

    def _places(self) -> torch.Tensor:
        """`(capacity,)` each held row's place among the held rows (`rows()`' order), -1 where free."""
        held = torch.tensor([label is not None for label in self.row_labels], device=self.graph.state.done.device)
        return torch.where(held, held.long().cumsum(0) - 1, -1)

    def _reach(self) -> None:
        """Let an eager pass attend to the slots in use (`GraphPass.attend`). Where rows joined late or left, most of
        those may be holes in every row: a server's runner, whose slot only moves on, would attend to most of its
        slots. So when the reach must grow, past twice what the fullest row holds, the cache is compacted first."""
        g, end = self.graph, self.slot + self.shape.width
        reach = g.reach_for(end)
        if g.reach is not None and reach > g.reach and g.cuts:
            held = int(g.state.real[:, : self.slot].sum(dim=1).max())
            if 2 * (held + self.shape.width) < reach:
                self._compact()
                reach = g.reach_for(self.slot + self.shape.width)
        g.attend(reach)

    def _compact(self) -> None:
        """Squeeze the holes out of the cache (free rows hold none)."""
        free = [row for row, label in enumerate(self.row_labels) if label is None]
        if free:
            self.graph.state.real[free] = False
        self.slot = self.graph.compact(self.slot)

    @property
    def last_accepted(self) -> torch.Tensor:
        """`(capacity,)` tokens each row took in the last pass."""
        state = self.graph.state
        return state.accepted_log[state.logged - 1][0] if self.log else state.accepted_log[0]

    @_in_own_mode
    def rows(self) -> list[tuple[object, list[int], bool, int]]:
        """Every held row as `(label, its new tokens so far, whether it has stopped, passes it took part in)`: two
        reads from the device (the counts, then the tokens they reach). A server reads them after every pass (a row's
        passes are counted here, from the last pass's tokens)."""
        state = self.graph.state
        if self.unread_passes:  # a row takes a token in every pass it decodes in
            self.passes += self.last_accepted > 0
            self.unread_passes = 0
        counts = torch.stack([state.decoded, state.done.long(), self.passes, state.text_end])
        decoded, done, passes, ends = counts.tolist()
        text = state.sequences[:, : max(ends)].tolist()
        return [
            (label, text[row][ends[row] - decoded[row] : ends[row]], bool(done[row]), passes[row])
            for row, label in enumerate(self.row_labels)
            if label is not None
        ]

    @_in_own_mode
    def release(self, labels) -> None:
        """The rows of these labels stop decoding and are free at once: they feed nothing more (their last tokens
        need no caching), and where an eager pass on a CPU computes the rows from the first held to the last, the last
        held rows move into the free rows before them (`_condense`)."""
        rows = [self.row_labels.index(label) for label in labels]
        for row in rows:
            self.row_labels[row] = None
        self.graph.free(torch.tensor(rows, dtype=torch.long, device=self.graph.state.done.device))
        if self.condenses and self.graph.cuts:
            self._condense()

    def _condense(self) -> None:
        """Move the last held rows into the free rows before them, so that the held rows come first and a pass
        computes no free row (`GraphPass.take_rows` feeds the rows from the first held to the last): one copy of a
        moved row's K/V and state (`GraphPass.move_rows`, vLLM's condensing of its persistent batch), where the free
        rows between would have been computed in every pass until another row joined there."""
        free = [row for row, label in enumerate(self.row_labels) if label is None]
        held = [row for row, label in enumerate(self.row_labels) if label is not None]
        moves = []
        while free and held and free[0] < held[-1]:
            moves.append((held.pop(), free.pop(0)))
        if not moves:
            return
        device = self.graph.state.done.device
        sources, targets = (torch.tensor(rows, device=device) for rows in zip(*moves))
        self.graph.move_rows(sources, targets, self.slot)
        for source, target in moves:
            self.row_labels[target], self.row_labels[source] = self.row_labels[source], None
        for tensor in (self.lead, self.passes):
            tensor.index_copy_(0, targets, tensor.index_select(0, sources))
        self._follow_padding(int(self.lead.max()) + 1)

    def _follow_padding(self, width: int) -> None:
        """Where each row's text begins and its left padding ends (within its first `width` columns), for the
        processors that read them (`scoring.follow_padding`), as rows join and move."""
        g = self.graph
        padded = torch.arange(width, device=self.lead.device) >= self.lead[:, None]
        follow_padding(g.processors or (), padded, g.text_start)


def runner_tree(plan) -> DraftTree:
    """The draft tree of a runner's passes: lossless mode's full tree (the one a static cache's passes propose), else
    none."""
    settings = plan.settings
    return full_tree(settings.block_size - 1, plan.candidates, plan.lookup) if settings.verify else NO_DRAFTS


def _tree_settings(settings) -> dict:
    """The settings that name a lossless draft tree (or none: τ = 1), which `Runner.retree` changes."""
    names = ("verify", "tau", "block_size", "draft_candidates", "lookup", "accept")
    return {name: getattr(settings, name) for name in names}


def _tree_nodes(shape: GraphShape, verify: bool, masks: int, candidates, lookup: int) -> torch.Tensor:
    """`(nodes,)` which nodes of `shape`'s full tree (`full_tree`) a tree of `masks` masks, `candidates` and `lookup`
    has: the chain to that depth, the first runner-ups of each of its depths, the first of lookup's branch (none
    where `verify` is off: plain decoding). A `ValueError` where that tree is not within `shape`'s."""
    wide = depth_candidates(shape.candidates, shape.masks)
    narrow = depth_candidates(candidates, masks) + (0,) * (shape.masks - masks)
    if masks > shape.masks or any(n > w for n, w in zip(narrow, wide)) or lookup > shape.lookup:
        raise ValueError(f"A tree of {masks} masks, {candidates} candidates and lookup {lookup} is not the runner's.")
    nodes = [verify and depth < masks for depth in range(shape.masks)]
    for w, n in zip(wide, narrow):
        nodes += [verify and i < n - 1 for i in range(w - 1)]
    nodes += [verify and i < lookup for i in range(shape.lookup)]
    return torch.tensor(nodes[: len(shape.tree)], dtype=torch.bool)


def _tree_of(plan) -> dict:
    """The fields of `plan` that its draft tree is made of (`graph_shape`'s `plan`)."""
    return dict(settings=plan.settings, candidates=plan.candidates, lookup=plan.lookup)


def widest_plan(plan, trees):
    """`plan` with the union of its lossless tree and `trees`' (settings of the same mode, drafting other trees or
    none): each depth's most candidates, the longest lookup. What a runner that re-chooses its tree is built for."""
    verifying = [s for s in (plan.settings, *trees) if s.verify]
    if not verifying:
        return plan
    widest = max(verifying, key=lambda s: s.block_size)
    depths = widest.block_size - 1
    counts = [max(c) for c in zip(*(depth_candidates(s.draft_candidates, depths) for s in verifying))]
    settings = replace(widest, draft_candidates=canonical_candidates(counts), lookup=max(s.lookup for s in verifying))
    candidates, lookup = draft_shape(settings, plan.do_sample, plan.typical, plan.processors)
    return replace(plan, settings=settings, candidates=candidates, lookup=lookup)


def no_runner(plan, compiled: bool = False) -> str | None:
    """Why no runner decodes `plan`'s rows, or None where one does: a compiled pass calls no logits processor that
    transformers alone applies. (What the model must be, `generate()` checks first: `_check_one_runner`.)"""
    if compiled and processor_fields(plan.processors)["calls"]:
        return (
            "a compiled pass cannot call logits processors that only transformers applies (a grammar, bad words or "
            "sequence biases of several tokens, forced tokens) between its slots: decode them eagerly"
        )
    return None


def graph_shape(session, batch: int, slots: int, tree: DraftTree, compiled: bool = False, **plan):
    """The `GraphShape` of `batch` rows decoding as `session`'s do, on a static cache of `slots` slots with lossless
    mode's full `tree`, or None where no runner can (`no_runner`). Warpers, single-token bans and biases, repetition
    penalties, minimum lengths and n-gram bans run in any pass by MARS's rules (`scoring.by_rules`); logits processors
    that transformers alone applies (a grammar, bans and biases of several tokens, forced tokens) are called on each
    slot's text, which an eager pass can do and a `compiled` one cannot. A mask cost's schedule runs in the pass too,
    which feeds every mask. Stopping criteria other than EOS and the length limit, and a streamer, are served from the
    host after each pass. `plan`: fields of `run.plan` replaced (a runner's wider tree)."""
    plan = replace(session.plan, **plan) if plan else session.plan
    if no_runner(plan, compiled) is not None:
        return None
    settings, processing = plan.settings, processor_fields(plan.processors)
    verify = settings.verify
    masks = 0 if not verify and not callable(settings.tau) and settings.tau >= 1.0 else settings.block_size - 1
    return GraphShape(
        batch=batch,
        slots=slots,
        verify=verify,
        pending=1 if verify or not masks else settings.block_size,
        tree=tree,
        masks=masks,
        confidence=settings.confidence,
        candidates=plan.candidates,
        lookup=plan.lookup,
        mask_token_id=settings.mask_token_id,
        pad_token_id=plan.pad_token_id,
        eos=plan.eos.numel(),
        sampled=plan.do_sample,
        typical=plan.typical,
        **processing,
        window=plan.window.size if plan.window else 0,
        sliding_only=bool(plan.window and plan.window.everywhere),
        scheduled=bool(masks) and not session.schedule.constant,
    )


def serving_runner(
    model, first, capacity: int, slots: int, compile_config=None, log: bool = False, trees=(), kv=None
) -> Runner:
    """A runner of `capacity` rows and a static cache of `slots` slots of its own, decoding with the settings of
    `first` (a prepared session, whose rows it then admits). `compile_config`: `generate()`'s, to compile the pass
    (and capture it on CUDA), else None (eager). `log`: `Runner`'s. `trees`: other settings its rows may be re-treed
    to (`Runner.retree`, eager runners): the pass is built for the union of their trees (`widest_plan`). `kv`: a
    cache of `rows_cache(model, capacity, slots)` to decode on, a runner's that is gone (a server's rows changing
    their settings: their K/V storage is not allocated again); else one is allocated."""
    tree_plan = widest_plan(first.plan, trees) if trees and compile_config is None else first.plan
    compiled = compile_config is not None
    shape = graph_shape(first, capacity, slots, runner_tree(tree_plan), compiled, **_tree_of(tree_plan))
    if shape is None:
        raise ValueError(f"No runner decodes these rows: {no_runner(tree_plan, compiled)}.")
    if kv is None or static_cache_size(kv) != slots or kv.layers[0].keys.shape[0] != capacity:
        kv = rows_cache(model, capacity, slots)
    graph = GraphPass(model, kv, shape, compile_config, first.plan.processors)
    return Runner(first.plan, graph, log, tree_plan)


def rows_cache(model, rows: int, slots: int):
    """transformers' `StaticCache` of `rows` rows and `slots` slots, its layers allocated now, stacked."""
    from transformers import StaticCache

    kv = StaticCache(config=full_attention_config(model.config), max_cache_len=slots)  # the pass builds the windows
    allocate_layers(kv, model, rows)
    return kv


def load_rows(g: GraphPass, session, targets: torch.Tensor) -> None:
    """What each row of `session` (after its prompt's pass) decodes next, into the graph pass's rows `targets`:
    budget and count, whether done, the last pending position, the pending tokens and drafts, the mask schedule; then
    every row's text end and the tokens each history holds, found from the text."""
    plan, text, feed, state = session.plan, session.text, session.feed, g.state
    whole = targets.numel() == state.done.numel()  # every row, in order: copied whole

    def put(buffer, values):  # `buffer`'s rows `targets` <- `values`, or a number
        if not whole:
            buffer[targets] = values
        elif isinstance(values, torch.Tensor):
            buffer.copy_(values)
        else:
            buffer.fill_(values)

    put(state.budget, text.budget)
    put(state.decoded, text.decoded)
    put(g.live, text.active)
    put(state.done, ~text.active)
    put(state.last_position, session.cache.next_position + feed.pending_real.sum(dim=1) - 1)
    pad = g.shape.pending - feed.pending.shape[1]  # τ-mode after a pass without masks: holes on the left
    put(g.pending, torch.nn.functional.pad(feed.pending, (pad, 0), value=plan.pad_token_id))
    put(g.pending_real, torch.nn.functional.pad(feed.pending_real, (pad, 0), value=False))
    if feed.drafts.tree == g.shape.tree:
        put(g.drafts, feed.drafts.tokens)
        put(g.drafts_real, feed.drafts.real)
        if g.proposals is not None:
            put(g.proposals, feed.drafts.proposals)
    else:  # drafts of another shape: the next pass verifies none, drawing from the model alone
        put(g.drafts_real, False)
        if g.proposals is not None:
            put(g.proposals, 0)
    if g.shape.scheduled:  # each row's mask schedule, as its last pass left it (every row's costs are the run's)
        state.time.copy_(session.schedule.time)
        put(state.rate, session.schedule.rate)
        put(state.last, session.schedule.last)
        put(state.passes, text.passes)
    torch.add(g.text_start, state.decoded, out=state.text_end)
    torch.sub(state.text_end, 1, out=state.text_last)
    g.find_held()
