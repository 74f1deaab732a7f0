"""A server's rows in one graph pass of fixed shape: continuous batching on a static cache.

`hf-mars serve --compile` decodes as `generate()` does on a GPU: a static cache, and every pass one graph
(`decoding/graph.py`, captured as a CUDA graph on CUDA). A static cache keeps its batch, so rows cannot join a
`Session` of one; here the graph pass's batch is `max_rows` fixed rows instead, each free or held by a request. A
request's prompt pass runs as in any session (`model.mars_session`, a dynamic cache of its own), then its row moves
into a free row between two passes: its real K/V slots, its text, its budget and what its next pass feeds. A row that
stops is free at once; it decodes nothing (a free row is a done one) until a request takes it. Every row shares the
cache slot the next pass writes; a row that joins is placed just before it (holes before), and compaction squeezes the
holes out when a pass would not fit, as in `generate()`.

The engine (`engine.py`) drives it as it drives a `Session`: `admit`, `step`, `rows`, `release`.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import StaticCache

from ..decoding.cache import allocate_stacked
from ..decoding.compat import full_attention_config
from ..decoding.generate import graph_shape, load_rows
from ..decoding.graph import GraphPass
from ..decoding.scoring import follow_padding, processors_signature
from ..decoding.settings import read_tau
from ..decoding.tree import NO_DRAFTS, full_tree


class GraphSession:
    """`max_rows` rows decoding in one graph pass over a static cache of `slots` slots, with the settings of `first`
    (a session after its prompt pass, whose rows it admits). `compile_config`: `generate()`'s, to compile the pass
    (and capture it on CUDA), else None (eager)."""

    def __init__(self, model, first, max_rows: int, slots: int, compile_config=None):
        settings, plan = first.plan.settings, first.plan
        tree = full_tree(settings.block_size - 1, plan.candidates, plan.lookup) if settings.verify else NO_DRAFTS
        shape = graph_shape(model, first, max_rows, slots, tree)
        if shape is None:
            raise ValueError(
                "these settings decode in the loop, not as one graph (logits processors that only transformers "
                "applies, such as bad words or sequence biases of several tokens): serve them without --compile"
            )
        self.model, self.plan, self.shape = model, plan, shape
        self.processors = processors_signature(plan.processors, layout=False)
        self.graph = GraphPass(model, _static_cache(model, max_rows, slots), shape, compile_config, plan.processors)
        no_padding = torch.ones(max_rows, 1, dtype=torch.bool, device=self.graph.state.done.device)
        # Texts start at column 0, as a prompt alone's; each row's prompt ends where its new tokens start
        # (`text_start`, a view of the pass's state, written as rows are placed)
        follow_padding(plan.processors, no_padding, self.graph.text_start)
        self.graph.state.done.fill_(True)  # every row free
        self.graph.state.sequences.fill_(plan.pad_token_id)
        self.graph.state.write_offsets.copy_(self.graph.offsets + 1)  # a free row's text: one pad (processors read it)
        self.graph.eos.copy_(plan.eos)
        self.held: list = [None] * max_rows  # each row's label, None where free
        self.passes = [0] * max_rows
        self.slot, self.tau = 0, None

    @property
    def labels(self) -> list:
        return [label for label in self.held if label is not None]

    @property
    def live(self) -> bool:
        return bool(self.labels)

    @property
    def decoding(self) -> int:
        """Rows held (a row is freed the moment it stops)."""
        return len(self.labels)

    joins, retrees = True, False  # rows join free rows between passes; the tree keeps the graph's shape

    def decodes_like(self, other) -> bool:
        """Whether `other`'s rows decode with these settings, sampling and processors, stop at the same EOS tokens, and
        make the same graph pass (`generate.graph_shape`: the pad id, windows, tree and schedule too)."""
        mine, theirs = self.plan, other.plan
        same = (theirs.settings, theirs.do_sample, theirs.typical) == (mine.settings, mine.do_sample, mine.typical)
        processed = processors_signature(theirs.processors, layout=False) == self.processors
        if not (same and processed and torch.equal(theirs.eos, mine.eos)):
            return False
        shape = graph_shape(self.model, other, self.shape.batch, self.shape.slots, self.shape.tree)
        # the processors' row layout (where each text starts) is each row's own; the rest must be equal
        return shape is not None and replace(shape, processors=()) == replace(self.shape, processors=())

    def refusal(self, other) -> str | None:
        """Why `other`'s rows cannot join (None: they can)."""
        if not self.decodes_like(other):
            return "the rows decode with other settings"
        if len(other.feed.rows) > self.held.count(None):
            return f"{len(other.feed.rows)} rows, {self.held.count(None)} free"
        text = other.text
        longest = int((text.prompt_real.sum(dim=1) + text.budget).max()) + self.shape.width
        if longest > self.shape.slots:
            return f"a prompt and its max_tokens need {longest} cache slots, more than the {self.shape.slots} served"
        return None

    def admit(self, other) -> None:
        """`other`'s rows (a session after its prompt pass, the same settings) into free rows, between two passes."""
        reason = self.refusal(other)
        if reason is not None:
            raise ValueError(f"These rows cannot join the session: {reason}.")
        real, kv = other.cache.real_slots(other.text.sequences.shape[0])
        stacked = torch.stack([t for pair in kv for t in pair])  # (2 x layers, rows, heads, slots, dim)
        for index, row in enumerate(other.feed.rows.tolist()):
            free = self.held.index(None)
            self._place(other, index, row, free, real[row], stacked[:, row])
            self.held[free], self.passes[free] = other.labels[row], int(other.text.passes[row])

    def _place(self, other, index: int, row: int, free: int, real: torch.Tensor, states: torch.Tensor) -> None:
        """Text row `row` of `other` (its `index`-th fed row) into graph row `free`: its real K/V slots end just
        before the slot the next pass writes, its text starts at column 0 (no left padding); then what it decodes
        next (`load_rows`)."""
        g, state, text = self.graph, self.graph.state, other.text
        count = int(real.sum())
        if count > self.slot:  # the next pass writes after every row's slots: the other rows get holes
            state.real[:, self.slot :] = False
            self.slot = count
            g.move_to(count)  # where the pass writes, and where each layer does
            for written in g.lengths:
                written.fill_(count)
        slots = slice(self.slot - count, self.slot)
        for target, source in zip([t for layer in g.kv.layers for t in (layer.keys, layer.values)], states):
            target[free, :, slots] = source[:, real]
        state.real[free] = False
        state.real[free, slots] = True
        prompt = text.sequences[row, : text.prompt_length][text.prompt_real[row]]
        decoded = int(text.decoded[row])
        tokens = torch.cat([prompt, text.sequences[row, text.prompt_length : text.prompt_length + decoded]])
        state.sequences[free] = self.plan.pad_token_id
        state.sequences[free, : tokens.numel()] = tokens
        state.write_offsets[free] = g.offsets + prompt.numel()
        device = state.done.device
        load_rows(g, other, torch.tensor([free], device=device), torch.tensor([index], device=device))

    def step(self, model=None) -> None:
        """One pass for every row (free rows decode nothing): one launch, or one graph replay."""
        g, state = self.graph, self.graph.state
        tau = read_tau(self.plan.settings.tau)
        if tau != self.tau:
            g.aim(tau)
            self.tau = tau
        if self.slot + self.shape.width > self.shape.slots:
            state.real[[row for row, label in enumerate(self.held) if label is None]] = False
            self.slot = g.compact(self.slot)
        state.step.zero_()  # each pass's accepted counts are read after it, in row 0
        g.run()
        self.slot += self.shape.kept

    def rows(self) -> list[tuple[object, list[int], bool, int]]:
        """Every held row as `(label, its new tokens so far, whether it has stopped, passes it took part in)`: two
        reads from the device (the counts, then the tokens they reach)."""
        state = self.graph.state
        counts = torch.stack([state.decoded, state.done.long(), state.accepted_log[0], state.text_end])
        decoded, done, took, ends = counts.tolist()
        text = state.sequences[:, : max(ends)].tolist()
        out = []
        for row, label in enumerate(self.held):
            if label is not None:
                self.passes[row] += took[row] > 0
                first = ends[row] - decoded[row]
                out.append((label, text[row][first : ends[row]], bool(done[row]), self.passes[row]))
        return out

    def release(self, labels) -> None:
        """The rows of these labels stop decoding and are free at once."""
        for label in labels:
            row = self.held.index(label)
            self.held[row] = None
            self.graph.state.done[row] = True


def _static_cache(model, rows: int, slots: int) -> StaticCache:
    """transformers' `StaticCache` of `rows` rows and `slots` slots, its layers allocated now, stacked."""
    kv = StaticCache(config=full_attention_config(model.config), max_cache_len=slots)  # the pass builds the windows
    allocate_stacked(kv, model, rows)
    if not all(layer.is_initialized for layer in kv.layers):  # not stackable here: each layer allocated alone
        config = model.config.get_text_config()
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv.early_initialization(rows, heads, head_dim, model.dtype, model.device)
    return kv
