"""The MARS pass as one graph: fixed shapes, tensors for every number that changes, no host sync inside.

On a GPU a small model's step is bound by the host: every kernel launched from Python costs about as much as it
computes. A MARS pass does more than a plain step (acceptance, the cache's books, the next drafts), so launched op by
op it costs twice a plain step and eats the tokens it wins. Here the whole pass is one function of a `GraphState`,
whose tensors keep their shapes and their addresses from pass to pass: what a pass writes (the cache slot it starts
at, each row's text, positions, drafts, whether it is done) is written in place, and nothing in it asks the host.
On CUDA, under `generate()`'s compile path, the pass is captured once as a CUDA graph (the forward compiled by
inductor inside it) and replayed: one launch and one read of `finished` per pass. On other devices under that path
the whole pass is one compiled function; without it the same function runs eagerly, which is what the tests check
against the loop of `generate.py`.

What it runs: a static cache, greedy decoding without logits processors, τ-mode with all B-1 masks in every pass
(τ >= 1 then accepts slot 0 alone: exactly greedy) and lossless mode's exact verification over a whole draft tree
(chain, runner-ups, prompt lookup). User stopping criteria, stop strings and a streamer are served by the host loop
between passes. `generate.py` hands a run over after its first pass (the prompt's) where `_graph_shape` finds one,
and runs everything else itself.

This file is copied into MARS checkpoints (trust_remote_code).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .compat import CACHE_ARG, many_shapes
from .scoring import choose
from .tree import DraftTree
from .verify import Drafts, add_lookup, propose, verify

WARMUP_PASSES = 2  # eager passes (real ones) before a CUDA graph is captured, as CUDA's capture rules ask
GRAPHS_KEPT = 8  # graph passes kept per model (each holds a static cache, its buffers and, on CUDA, its graph)
# Whether `generate.py` hands runs over to the graph pass (`enabled()`); tools turn it off to measure the loop alone
ENABLED = True


def enabled() -> bool:
    return ENABLED


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


@dataclass
class GraphState:
    """What a graph pass reads and writes in place, for every row of the batch (rows stay until all are done)."""

    sequences: torch.Tensor  # (batch, slots): prompt, then the decoded tokens, then pad
    prompt_length: torch.Tensor  # () the prompt's width
    budget: torch.Tensor  # (batch,) new tokens each row may take
    decoded: torch.Tensor  # (batch,) new tokens decoded
    passes: torch.Tensor  # (batch,) passes each row took part in
    done: torch.Tensor  # (batch,) rows that reached EOS or the length limit
    finished: torch.Tensor  # () every row done
    real: torch.Tensor  # (batch, slots) which cache slots hold real tokens
    slot: torch.Tensor  # () the first slot the next pass writes
    next_position: torch.Tensor  # (batch,) position id of each row's next real token
    pending: torch.Tensor  # (batch, pending)
    pending_real: torch.Tensor
    drafts: torch.Tensor  # (batch, len(tree))
    drafts_real: torch.Tensor
    tau: torch.Tensor  # () the τ of the next pass (inf: accept or propose nothing)
    step: torch.Tensor  # () passes run
    accepted_log: torch.Tensor  # (slots, batch) tokens each row took in each pass

    @classmethod
    def empty(cls, shape: GraphShape, device) -> GraphState:
        batch, slots = shape.batch, shape.slots
        long = dict(dtype=torch.long, device=device)
        flag = dict(dtype=torch.bool, device=device)
        return cls(
            sequences=torch.zeros(batch, slots, **long),
            prompt_length=torch.zeros((), **long),
            budget=torch.zeros(batch, **long),
            decoded=torch.zeros(batch, **long),
            passes=torch.zeros(batch, **long),
            done=torch.zeros(batch, **flag),
            finished=torch.zeros((), **flag),
            real=torch.zeros(batch, slots, **flag),
            slot=torch.zeros((), **long),
            next_position=torch.zeros(batch, **long),
            pending=torch.zeros(batch, shape.pending, **long),
            pending_real=torch.zeros(batch, shape.pending, **flag),
            drafts=torch.zeros(batch, len(shape.tree), **long),
            drafts_real=torch.zeros(batch, len(shape.tree), **flag),
            tau=torch.zeros((), dtype=torch.float32, device=device),
            step=torch.zeros((), **long),
            accepted_log=torch.zeros(slots, batch, **long),
        )


class GraphPass:
    """One shape's pass, its state and (on CUDA, compiled) its captured graph: `run()` decodes one pass.

    Everything a pass needs that does not change from pass to pass (index ranges, the tree's visibility, each fed
    token's position relative to the row's next one) is built here once, so that a pass launches only what it must.
    """

    def __init__(self, model, kv, shape: GraphShape, compile_config=None):
        """`compile_config`: `generate()`'s, where it compiles, else None (eager). On CUDA the pass is then captured
        whole as a CUDA graph around a forward compiled without CUDA graphs of its own; elsewhere the whole pass is
        compiled as one function. (Compiled whole on CUDA, the tree's host-side constants are traced into the graph as
        host-to-device copies, which CUDA graph capture refuses.)"""
        self.model, self.shape = model, shape
        self.kv = copy.deepcopy(kv)  # its own cache, at fixed addresses: each run's K/V are copied in (`load_cache`)
        device = kv.layers[0].keys.device
        self.state = GraphState.empty(shape, device)
        self.capture = compile_config is not None and device.type == "cuda"
        self.forward, self.step = model, graph_pass
        if self.capture:  # the forward compiled without CUDA graphs of its own; the pass around it is captured
            self.forward = _compiled(model.__call__, compile_config, "default")
        elif compile_config is not None:  # the whole pass compiled as one function
            self.step = _compiled(graph_pass, compile_config)
        self.lengths = [layer.cumulative_length for layer in self.kv.layers]
        self.tensors = [t for layer in self.kv.layers for t in (layer.keys, layer.values)] + self.lengths
        self.eos = torch.zeros(shape.eos, dtype=torch.long, device=device)
        batch, width, masks = shape.batch, shape.width, shape.groups * shape.masks
        visible = shape.tree.visibility(shape.pending, shape.masks)
        before, after = torch.ones(width, 1, dtype=torch.bool), torch.zeros(width, 1, dtype=torch.bool)
        self.sees = torch.cat([before, visible, after], dim=1).to(device)  # by key slot - pass slot + 1, clamped
        self.relative = _relative_positions(shape).to(device)
        self.key_slots = torch.arange(shape.slots, device=device)
        self.pass_slots = torch.arange(width, device=device)
        self.offsets = torch.arange(max(shape.pending, len(shape.tree) + 1, shape.masks + 1), device=device)
        self.mask_ids = torch.full((batch, masks), shape.mask_token_id, dtype=torch.long, device=device)
        self.masks_real = torch.ones(batch, masks, dtype=torch.bool, device=device)
        self.unkept = torch.zeros(batch, width - shape.kept, dtype=torch.bool, device=device)
        self.within = torch.ones(batch, shape.masks, dtype=torch.bool, device=device)
        self.rows = torch.arange(batch, device=device)
        self.open = torch.zeros((), dtype=model.dtype, device=device)  # the additive mask's two values
        self.shut = torch.tensor(torch.finfo(model.dtype).min, dtype=model.dtype, device=device)
        self.graph, self.eager_runs = None, 0

    def load_cache(self, kv) -> None:
        """Copy a run's K/V and write positions (a static cache of this shape) into this pass's own cache."""
        torch._foreach_copy_(
            self.tensors,
            [t for layer in kv.layers for t in (layer.keys, layer.values)]
            + [layer.cumulative_length for layer in kv.layers],
        )

    def run(self) -> None:
        """One pass: the graph replayed, else (before capture, or off CUDA) the pass itself."""
        if self.graph is not None:
            self.graph.replay()
        elif self.capture and self.eager_runs >= WARMUP_PASSES:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):  # records the pass; nothing runs until `replay`
                self.step(self)
            self.graph.replay()
        elif self.capture:  # warm-up passes run on a side stream, as CUDA graph capture requires
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.step(self)
            torch.cuda.current_stream().wait_stream(stream)
            self.eager_runs += 1
        else:
            self.step(self)


def _relative_positions(shape: GraphShape) -> torch.Tensor:
    """`(width,)`: each fed token's position past the first pending slot's, were every pending slot real: pending
    tokens in a row, each draft its depth past the last, each group of masks continuing the token it follows."""
    last = shape.pending - 1
    anchors = [last] + [last + depth for depth in shape.tree.path_lengths]
    masks = [anchor + k for anchor in anchors[: shape.groups] for k in range(1, shape.masks + 1)]
    return torch.tensor(list(range(shape.pending)) + anchors[1:] + masks, dtype=torch.long)


def graph_pass(g: GraphPass) -> None:
    """One MARS pass over `[pending | drafts | groups of masks]`, everything it decides written into `g.state`."""
    logits, slots = _forward(g)
    tokens, accepted, kept, end = _accept(g, logits)
    _commit(g, slots, tokens, accepted, kept)
    _next_inputs(g, logits, tokens, accepted, end)
    torch.all(g.state.done, out=g.state.finished)


def _forward(g: GraphPass) -> tuple[torch.Tensor, torch.Tensor]:
    """The pass's forward: its slots marked in the slot map, positions counted in real tokens, a 4D mask of the slot
    map and the tree's visibility. `(logits from the last pending token on, in float32, the slots written)`."""
    shape, state = g.shape, g.state
    slots = state.slot + g.pass_slots
    state.real.index_copy_(1, slots, torch.cat([state.pending_real, state.drafts_real, g.masks_real], dim=1))
    first = state.next_position  # lossless: the one pending token is always real
    if not shape.verify:  # right-aligned pending tokens, the first real ones of `count`
        first = first + state.pending_real.sum(dim=1) - shape.pending
    positions = (first[:, None] + g.relative).clamp_(min=0)
    input_ids = torch.cat([state.pending, state.drafts, g.mask_ids], dim=1)
    needed = shape.width - shape.pending + 1
    out = g.forward(
        input_ids=input_ids,
        attention_mask=_slot_attention(g, state.slot),
        position_ids=positions,
        use_cache=True,
        return_dict=True,
        logits_to_keep=needed,
        **{CACHE_ARG: g.kv},
    )
    return out.logits[:, -needed:].float(), slots


def _slot_attention(g: GraphPass, slot: torch.Tensor) -> torch.Tensor:
    """`(batch, 1, width, slots)` additive mask of a pass written from `slot` on: a query sees the real slots before
    the pass and, within it, the real ones the tree's visibility allows."""
    width = g.shape.width
    column = (g.key_slots - slot).clamp_(-1, width).add_(1)  # 0: before the pass, width + 1: after it
    allowed = g.sees[:, column][None] & g.state.real[:, None, :]
    return torch.where(allowed, g.open, g.shut)[:, None]


def _accept(g: GraphPass, logits: torch.Tensor):
    """`(tokens, accepted, kept drafts, end)`: τ's test or exact verification, then EOS and the length limit."""
    shape, state = g.shape, g.state
    kept = end = None
    if shape.verify:
        drafts = Drafts(state.drafts, state.drafts_real, shape.tree)
        tokens, accepted, kept, end = verify(logits[:, : len(shape.tree) + 1], drafts, None, False)
    elif shape.masks:
        tokens, confs = choose(logits, None, False, shape.confidence)
        accepted = (confs[:, 1:] >= state.tau).cumprod(dim=1, dtype=torch.long).sum(dim=1).add_(1)
    else:  # τ >= 1 throughout: one token a pass, no masks
        tokens = logits.argmax(dim=-1)
        accepted = g.masks_real.new_ones(shape.batch, dtype=torch.long)
    accepted, ended = cut(tokens, accepted, state.budget - state.decoded, state.done, g.eos)
    state.accepted_log.index_copy_(0, state.step[None], accepted[None])
    state.passes.add_(~state.done)
    state.done.logical_or_(ended)
    return tokens, accepted, kept, end


def cut(tokens, accepted, left, idle, eos):
    """`(accepted, ended)`: what each row takes of `tokens[:, :accepted]`, stopped by the `left` tokens its budget
    allows and by the first of the `eos` ids; `idle` rows (no longer decoding) take nothing."""
    accepted = torch.minimum(accepted, left).masked_fill_(idle, 0)
    ended = accepted >= left
    if eos.numel():
        slots = torch.arange(tokens.shape[1], device=tokens.device)
        is_eos = torch.isin(tokens, eos) & (slots < accepted[:, None])
        hit = is_eos.any(dim=1)
        accepted = torch.where(hit, is_eos.long().argmax(dim=1) + 1, accepted)
        ended = ended | hit
    return accepted, ended


def _commit(g: GraphPass, slots, tokens, accepted, kept) -> None:
    """The pending tokens and kept drafts stay cached, the rejected drafts as holes; the cache steps back over the
    masks, which the next pass overwrites. The accepted tokens go into the text."""
    shape, state = g.shape, g.state
    fed = torch.cat([state.pending_real, kept], dim=1) if shape.verify else state.pending_real
    state.real.index_copy_(1, slots, torch.cat([fed, g.unkept], dim=1))
    state.slot.add_(shape.kept)
    if shape.width > shape.kept:
        torch._foreach_sub_(g.lengths, shape.width - shape.kept)
    state.next_position.add_(fed.sum(dim=1))
    offsets = g.offsets[: tokens.shape[1]]
    where = (state.prompt_length + state.decoded)[:, None] + offsets
    state.sequences.scatter_(1, where, tokens.masked_fill(offsets >= accepted[:, None], shape.pad_token_id))
    state.decoded.add_(accepted)
    state.step.add_(1)


def _next_inputs(g: GraphPass, logits, tokens, accepted, end) -> None:
    """τ-mode: the accepted tokens, right-aligned. Lossless mode: the last token, and the drafts that the group of
    masks after the last kept draft proposes (the full tree, unfilled slots not real)."""
    shape, state = g.shape, g.state
    if not shape.verify:
        pending, pending_real = right_align(tokens, accepted, shape.pending, shape.pad_token_id, g.offsets)
        state.pending.copy_(pending)
        state.pending_real.copy_(pending_real)
        return
    state.pending.copy_(tokens.gather(1, (accepted - 1).clamp_(min=0)[:, None]))
    followed = logits[:, len(shape.tree) + 1 :].unflatten(1, (shape.groups, shape.masks))[g.rows, end]
    # The shape stands for the settings: `propose` reads their `confidence` only
    options = (None, state.tau, g.within, shape, False, shape.candidates, shape.pad_token_id, True)
    drafts = propose(followed, *options)
    if shape.lookup:
        lengths = state.prompt_length + state.decoded
        drafts = add_lookup(drafts, state.sequences, lengths, shape.lookup, shape.pad_token_id, True)
    state.drafts.copy_(drafts.tokens)
    state.drafts_real.copy_(drafts.real)


def right_align(tokens, counts, width: int, pad_token_id, offsets=None):
    """The first `counts[i]` tokens of each row, right-aligned (left-padded) to `width`: `(tokens, real)`, as a
    left-padded prompt is. `offsets`: `arange` of at least `width`, if the caller has one."""
    offsets = torch.arange(width, device=tokens.device) if offsets is None else offsets[:width]
    index = offsets + (counts - width)[:, None]
    real = index >= 0
    return tokens.gather(1, index.clamp(min=0)).masked_fill(~real, pad_token_id), real


def _compiled(function, config, mode=None):
    """`function` compiled with `generate()`'s `CompileConfig` (its backend; inductor's `mode` if given, which here
    means no CUDA graphs of its own), once per function and config, allowed `RECOMPILE_LIMIT` shapes."""
    key = (function, config.backend, mode or config.mode)
    if key not in _COMPILED:
        inductor = config.backend == "inductor"
        compiled = torch.compile(
            function, backend=config.backend, mode=(mode or config.mode) if inductor else None, dynamic=False
        )
        _COMPILED[key] = many_shapes(compiled)
    return _COMPILED[key]


_COMPILED: dict = {}


class _Graphs(dict):
    """A model's graph passes, by shape: a copy of the model (`copy.deepcopy`) starts with none and builds its own."""

    def __deepcopy__(self, memo):
        return _Graphs()


def graph_pass_for(model, kv, shape: GraphShape, compile_config=None) -> GraphPass:
    """The `GraphPass` of this shape, built once and kept on the model (a server's calls, each with a static cache of
    its own, share it), with `kv`'s K/V loaded."""
    graphs = model.__dict__.setdefault("_mars_graphs", _Graphs())
    compiling = None if compile_config is None else (compile_config.backend, compile_config.mode)
    key = (shape, compiling, model.dtype, str(kv.layers[0].keys.device))
    if key not in graphs:
        if len(graphs) >= GRAPHS_KEPT:
            graphs.clear()
        graphs[key] = GraphPass(model, kv, shape, compile_config)
    graphs[key].load_cache(kv)
    return graphs[key]
