"""The server's engine: one MARS runner that requests join between passes and leave the moment they stop.

Requests wait in a queue. One inference thread keeps a `Runner` (decoding/runner.py: fixed rows of one graph pass
over a static cache of `cache_slots` slots per row, allocated as the engine starts) and loops: take what has
arrived; prepare the waiting requests that decode with the running rows' settings (`model.mars_rows`, up to the
free rows) and admit them (`Runner.admit`: their prompt's pass, straight into their rows of the runner's cache); run
one pass for every row; hand each row's new tokens to its client; release the rows that stopped (EOS, their own
`max_tokens`, a stop string, or a client that went away) and answer them at once. MARS decodes ragged batches
exactly (a row's tokens do not depend on the rows beside it), so a request's text is the same whenever it joins.

Requests decode together when they share a `Request.key`: sampling, MARS mode, τ, tree (a response format's schema
and log probabilities are each row's own: `RowGrammars`, `Runner.logprobs`). A request with another key
waits until the running rows have finished; meanwhile no request joins them, so the wait is one batch at most. An
eager runner's pass records log probabilities for the rows that ask and calls the rows' grammars on each slot's text
(`Runner.use_processors`). A request the runner cannot take (its prompt and max_tokens beyond the slots; with
`--compile`, a grammar or log probabilities, which a compiled pass cannot serve) decodes apart once the running rows
are done: in an eager runner of its own, sized for it (`MARSEngine._graph_for`).

Rows that allow a τ range (`"mars_tau": [lo, hi]`) decode with a `TauController` of that range, which the engine sets
before every pass from `TauPolicy` (load.py): the load (rows, queue) and the measured pass costs.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch
from transformers.cli.serving.utils import BaseGenerateManager, DirectStreamer, _StreamError
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StopStringCriteria

from ..decoding.costs import NotMeasured, cost_batch, pass_costs, tree_key
from ..decoding.generate import own_cache_slots, session_settings
from ..decoding.runner import Runner, rows_cache, serving_runner
from ..decoding.scoring import follow_padding
from ..decoding.session import Session  # the rows a request group brings, prepared (`model.mars_rows`)
from ..decoding.settings import TauController
from ..decoding.tree import full_tree
from ..tools.measure.passes import declined, forget_declined, measure
from ..tools.measure.passes import pass_costs as time_pass_costs
from . import DEFAULT_CACHE_SLOTS
from .load import TauPolicy, check_tau_range
from .logprobs import TokenLogprobs
from .metrics import ServerMetrics
from .stops import StopQueue, cut_at_stop

logger = logging.getLogger("hf_mars.serve")

# A request's own limits; these keys of its generation config are the engine's to judge, per row
# Each row its own, whatever rows it decodes with: a schema too (`RowGrammars` gives each row its own grammar)
_PER_ROW_KEYS = ("max_new_tokens", "stop_strings", "token_logprobs", "response_format")
# What only sampling reads (transformers builds these warpers where `do_sample` is set): `temperature=0` and no
# temperature ask for the same greedy rows
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h")
RETRY_S = 60.0  # how often a server started on a busy machine tries to time its pass costs again
GROUP_WAIT_S = 2.0  # how long a seeded request's choices that arrived wait for the others (choices.py)


@dataclass(eq=False)  # a request is itself (a runner's label), whatever its fields
class Request:
    """One client's generation: its prompt, its own limits, and where its tokens go."""

    request_id: str
    input_ids: list[int]
    generation_config: object
    max_new_tokens: int
    sink: RowSink
    stop_strings: list[str] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    forward_passes: int = 0
    stop: StopStringCriteria | None = None
    arrived: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None  # when its last tokens were sent (metrics)
    taus: list[float] = field(default_factory=list)  # with a τ range: the τ of each pass it took part in
    scoring: TokenLogprobs | None = None  # where it asks for log probabilities: each sent token's goes there
    apart: bool = False  # it decodes in an eager runner of its own, once the running rows are done (`_apart`)
    grammar: str | None = None  # its response format's grammar (llguidance's), once its rows are prepared

    @property
    def tau_range(self) -> tuple[float, float] | None:
        """The `[lo, hi]` the request allows the server to choose τ in (server.py checked it), or None."""
        tau = getattr(self.generation_config, "mars_tau", None)
        return tuple(tau) if isinstance(tau, (list, tuple)) else None

    @property
    def group(self) -> dict | None:
        """A seeded request's choices (`{"group", "n", "seed"}`, choices.py): admitted together, once all wait."""
        return getattr(self.generation_config, "choices_group", None)

    @property
    def logprobs(self) -> int | None:
        """The alternatives it asks for beside its tokens' log probabilities (None: it asks for none)."""
        return getattr(self.generation_config, "token_logprobs", None)

    @property
    def key(self) -> str:
        """Requests with equal keys decode in one runner: same sampling and MARS settings (rows that ask for log
        probabilities decode with rows that do not: a runner records them for all; greedy rows whatever the
        sampling fields they carry, which greedy decoding never reads)."""
        config = self.generation_config.to_dict()
        config["do_sample"] = bool(config.get("do_sample"))  # unset is greedy
        for name in _PER_ROW_KEYS + (() if config["do_sample"] else _SAMPLING_KEYS):
            config.pop(name, None)
        return json.dumps(_plain_keys(config), sort_keys=True, default=str) + (" apart" if self.apart else "")

    def take(self, tokens: list[int], scored: list[tuple] | None = None) -> bool:
        """Hand the row's tokens past those already sent to its client; whether a stop string ended it (the token
        that completes one is the last sent, as `generate()` keeps it). `scored`: the new tokens' log probabilities
        (`(logprob, top values, top ids)` each), which go to `scoring` before each token is sent."""
        for i, token in enumerate(tokens[len(self.generated) :]):
            self.generated.append(token)
            if self.scoring is not None and scored is not None:
                self.scoring.entries.append((token, *scored[i]))
            self.sink.put(token)
            if self.stop is not None and bool(self.stop(torch.tensor([self.input_ids + self.generated]), None)[0]):
                return True
        return False


def _plain_keys(value):
    """`value` with every dict key a string (JSON's), such as `sequence_bias`'s tuples of token ids (`logit_bias`)."""
    if isinstance(value, dict):
        return {key if isinstance(key, str) else repr(key): _plain_keys(item) for key, item in value.items()}
    return value


def stop_strings_of(gen_config) -> list[str]:
    stop = gen_config.stop_strings
    return [stop] if isinstance(stop, str) else list(stop or [])


class RowSink:
    """Where one row's tokens go: a `DirectStreamer` (transformers serve's incremental detokenizer feeding the SSE
    queue) for a streaming client, or a future resolved with all tokens for a non-streaming one. `cancel()` is what
    the handler calls when the client disconnects."""

    def __init__(self, loop, streamer: DirectStreamer | None = None, queue=None, future: asyncio.Future | None = None):
        self.loop, self.streamer, self.queue, self.future = loop, streamer, queue, future
        self.cancelled = threading.Event()
        self.total_tokens = 0  # what transformers serve's stream handler reads to say whether the budget ended it

    def cancel(self) -> None:
        self.cancelled.set()

    def put(self, token_id: int) -> None:
        self.total_tokens += 1
        if self.streamer is not None:
            self.streamer.put(torch.tensor([token_id]))

    def finish(self, request: Request, error: Exception | None = None) -> None:
        """The row is over: the stream's end (or the future's result) is signalled last, after the engine has
        recorded the row's usage, so that the handler's last chunk reads it."""
        if self.streamer is not None:
            if error is not None:  # the handler sends it as the stream's last event
                self.loop.call_soon_threadsafe(self.queue.put_nowait, _StreamError(f"{type(error).__name__}: {error}"))
                return
            self.streamer.end()
        elif self.future is not None:
            result = error if error is not None else list(request.generated)
            self.loop.call_soon_threadsafe(_resolve, self.future, result)


def _resolve(future: asyncio.Future, result) -> None:
    if future.done():
        return
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)


class MARSEngine(BaseGenerateManager):
    """transformers serve's generation manager, with continuous batching: the handlers call `generate_streaming`
    and `generate_non_streaming` as they call its sequential `GenerateManager`; this one queues the request and
    returns, and its inference thread decodes it in the running runner."""

    def __init__(
        self,
        model,
        tokenizer,
        max_batch_size: int = 8,
        cache_slots: int = DEFAULT_CACHE_SLOTS,
        compile_config=None,
        tau_range: tuple[float, float] | None = None,
    ):
        """`cache_slots`: the runner's static cache slots per row (a prompt, its max_tokens and a pass must fit, or
        the request decodes apart). `compile_config`: compile the runner's pass (`serve --compile`), else it runs
        eagerly. `tau_range`: the τ range of requests that set no MARS field (the handlers give it them)."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if cache_slots < 1:
            raise ValueError(f"cache_slots must be at least 1, got {cache_slots}")
        self.tau_range = check_tau_range(tau_range) if tau_range is not None else None
        self.model, self.tokenizer, self.max_batch_size = model, tokenizer, max_batch_size
        self.cache_slots, self.compile_config = cache_slots, compile_config
        self._graph: Runner | None = None  # kept while idle: its graph is compiled (and captured) once
        self._kv = None  # the static cache of the first eager runner, allocated as the engine starts (`_serve`)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.batch_sizes: list[int] = []  # rows decoding in each pass, for tests and logs
        self._usage: OrderedDict[str, dict] = OrderedDict()  # finished rows' passes, until the handler reads them
        self.finished: deque[dict] = deque(maxlen=1024)  # the last rows decoded: what they took, whether cancelled
        self._queue: queue.Queue[Request | None] = queue.Queue()
        self._waiting: list[Request] = []
        self.runner: Runner | None = None  # the rows decoding now
        self._key: str | None = None  # the running rows' `Request.key`
        self._settings: dict = {}  # their resolved MARS settings, which every row that joins them decodes with
        self._controllers: dict[str, TauController] = {}  # per key with a τ range: the τ its rows decode with
        self._policies: dict[str, TauPolicy] = {}  # per key with a τ range: what each τ took there, measured
        self._banded: tuple | None = None  # (running runner's id, the rows its tree was chosen for)
        self.tree_changes: deque[tuple[int, str]] = deque(maxlen=256)  # (rows, tree) at each change, for tests
        self.metrics = ServerMetrics()
        self.scoring: dict[str, TokenLogprobs] = {}  # by request id, where the handler asks for log probabilities
        self._thread = threading.Thread(target=self._serve, name="mars-engine", daemon=True)
        self._thread.start()

    # -- the handlers' side (event loop) --

    def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
        loop = asyncio.get_running_loop()
        text_queue: asyncio.Queue = asyncio.Queue()
        rust_tokenizer = getattr(processor, "tokenizer", processor)._tokenizer
        stops = stop_strings_of(gen_config)
        into = StopQueue(text_queue, stops) if stops else text_queue  # the client's text ends before a stop sequence
        streamer = DirectStreamer(rust_tokenizer, loop, into, response_parser=response_parser)
        streamer.put(inputs["input_ids"][0])  # the streamer's first put is the prompt, which it skips
        sink = RowSink(loop, streamer=streamer, queue=text_queue)
        self.submit(request_id, inputs, gen_config, sink)
        return text_queue, sink

    async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
        loop = asyncio.get_running_loop()
        sink = RowSink(loop, future=loop.create_future())
        self.submit(request_id, inputs, gen_config, sink)
        try:
            generated = await sink.future
        except asyncio.CancelledError:
            sink.cancel()
            raise
        except ValueError as err:  # the request refused by the engine (too long for the cache's slots): a 400
            from fastapi import HTTPException

            raise HTTPException(status_code=400, detail=str(err)) from err
        text = cut_at_stop(processor.decode(generated, skip_special_tokens=True), stop_strings_of(gen_config))
        return text, inputs["input_ids"].shape[-1], generated

    def usage(self, request_id: str) -> dict | None:
        """A finished request's MARS usage (`forward_passes`, `tokens_per_forward`), read once by the handler."""
        return self._usage.pop(request_id, None)

    def submit(self, request_id: str, inputs, gen_config, sink: RowSink) -> None:
        input_ids = inputs["input_ids"]
        if input_ids.shape[0] != 1:
            raise ValueError("one prompt per request")
        stop_strings = stop_strings_of(gen_config)
        request = Request(
            request_id=request_id,
            input_ids=input_ids[0].tolist(),
            generation_config=gen_config,
            max_new_tokens=gen_config.max_new_tokens,
            sink=sink,
            stop_strings=stop_strings,
            stop=StopStringCriteria(self.tokenizer, stop_strings) if stop_strings else None,
            scoring=self.scoring.pop(request_id, None),
        )
        request.apart = self._apart(request)
        self._queue.put(request)

    def _apart(self, request: Request) -> bool:
        """Whether `request` decodes apart, in an eager runner of its own: a compiled runner's pass cannot call a
        grammar on each slot's text between its slots, and records log probabilities as it was compiled (an eager
        runner does both for the rows that ask)."""
        if self.compile_config is None:
            return False
        grammar = getattr(request.generation_config, "response_format", None) is not None
        return grammar or request.logprobs is not None

    def stop(self) -> None:
        self._queue.put(None)

    # -- the inference thread --

    @torch.inference_mode()
    def _serve(self) -> None:
        self._allocate()
        while self._arrivals(wait=self.runner is None):
            try:
                self._admit()
            except Exception as error:  # noqa: BLE001 - a bug here must not stop the server; the row it hit is answered
                logger.exception("admitting requests failed")
                if self._waiting:  # the oldest, which every later one waits for
                    self._finish(self._waiting.pop(0), error)
            if self.runner is not None:
                self._step()
            self._report()

    def _allocate(self) -> None:
        """An eager runner's static cache, allocated as the engine starts, before the first request waits on it. Where
        that fails (memory), the engine serves on: the first runner allocates its own, and its error answers the
        requests that needed it."""
        if self.compile_config is not None:
            return
        try:
            self._kv = rows_cache(self.model, self.max_batch_size, self.cache_slots)
        except Exception:  # noqa: BLE001 - the server must answer, not hang on a thread that died
            logger.exception("allocating the runner's cache failed; the first runner tries again")

    def _report(self) -> None:
        """The queue and the running rows' settings, for `/metrics`."""
        running = len(self.runner.labels) if self.runner is not None else 0
        self.metrics.queue(running, self._queued())
        self.metrics.settings(self._settings if self.runner is not None else None)

    def _queued(self) -> int:
        return len(self._waiting) + self._queue.qsize()

    def idle(self) -> bool:
        """No row decoding and none waiting."""
        return (self.runner is None or not self.runner.labels) and not self._queued()

    def _arrivals(self, wait: bool) -> bool:
        """Move what has arrived into `_waiting` (blocking for the first one if `wait`); False once stopped."""
        while True:
            try:
                request = self._queue.get(block=wait and not self._waiting)
            except queue.Empty:
                return True
            if request is None:
                return False
            self._waiting.append(request)
            wait = False

    def _admit(self) -> None:
        """Join the waiting requests that decode with the running rows (or, with none running, with the oldest
        waiting one), as room allows: into a runner, a group into each run of adjacent free rows, until the rows or
        the requests run out; none while an older request of other settings waits."""
        for request in [r for r in self._waiting if r.sink.cancelled.is_set()]:
            self._waiting.remove(request)
            self._finish(request)
        while self._waiting and self._admit_group():
            pass

    def _admit_group(self) -> bool:
        """The waiting requests that fit into the runner's free rows (the longest run of adjacent ones, which rows that
        join together take): whether any left the queue (joined, or answered with why not), so another may."""
        runner = self.runner
        if runner is not None and self._waiting[0].key != self._key:
            return False  # the running rows finish first
        key = self._waiting[0].key
        room = self.max_batch_size if runner is None else min(self.max_batch_size - runner.decoding, runner.room)
        group = [r for r in self._waiting if r.key == key][:room]
        if not group:
            return False
        choices = group[0].group
        if choices is not None:  # a seeded request's choices: together, once all wait, right after the seed
            if len(group) < min(choices["n"], self.max_batch_size) and not self._waited_for(group[0]):
                time.sleep(0.001)  # the others are a few event-loop steps behind
                return False
            torch.manual_seed(choices["seed"])
        self._waiting = [r for r in self._waiting if r not in group]
        joining = self._open(group)
        if joining is not None and joining.labels:
            self._join(joining, key)
        if self.runner is not None and not self.runner.live:
            self.runner = None
        return True

    @staticmethod
    def _waited_for(request: Request) -> bool:
        """Whether a seeded request's first choice has waited long enough for the others (some were cancelled, or
        did not arrive): then those that wait decode, reproducible or not."""
        return time.monotonic() - request.arrived > GROUP_WAIT_S

    def _join(self, joining: Session, key) -> None:
        """`joining`'s rows into the runner (built for them where none runs yet): their prompt's pass, then their
        first tokens sent. Where a group is refused, each row tries alone: only a row that cannot join (settings no
        runner decodes, say) is answered with why."""
        try:
            if self.runner is None:
                self.runner, self._key = self._graph_for(joining), key
            if self._beyond_slots(joining):
                return
            self._constrain(self.runner, joining)
            self.runner.admit(joining)  # the prompt's pass, into the runner's rows
            self._follow(self.runner)
        except Exception as error:  # noqa: BLE001 - settings resolved apart, no graph: answered with why
            logger.warning("%d rows could not join the runner: %s", len(joining.labels), error)
            if len(joining.labels) == 1:
                self._finish(joining.labels[0], error)
                return
            for request in joining.labels:
                alone = self._open([request])
                if alone is not None and alone.labels:
                    self._join(alone, key)
            return
        self.metrics.passed(len(joining.labels))
        self._deliver(self.runner)

    def _beyond_slots(self, joining: Session) -> bool:
        """Whether `joining`'s one row needs more cache slots than the runner has (its prompt and max_tokens): it then
        waits to decode apart, in a runner sized for it, once the running rows are done, rather than being refused.
        (Rows that join together and do not fit are tried one by one, `_join`.)"""
        runner = self.runner
        needed = runner.slots_needed(joining) if len(joining.labels) == 1 else 0
        if needed <= runner.shape.slots:
            return False
        request = joining.labels[0]
        logger.info("a request needs %d cache slots, the runner has %d: it decodes apart", needed, runner.shape.slots)
        request.apart = True  # another key: it decodes once the running rows are done
        self._waiting.insert(0, request)
        return True

    def _graph_for(self, first: Session) -> Runner:
        """The runner that `first`'s rows decode in: the one kept from earlier rows where their settings are the
        same, else a new one; for rows apart (`Request.apart`), an eager runner of their own, as many rows as they
        are and slots enough for the longest, whose cache goes with it."""
        if first.labels[0].apart:
            slots = own_cache_slots(first, int(first.text.budget.max()))
            return serving_runner(self.model, first, len(first.labels), slots)
        graph = self._graph
        if graph is None or not graph.decodes_like(first):
            kv = graph.graph.kv if graph is not None and graph.graph.graph is None else self._kv  # none captured
            self._graph = graph = self._kv = None  # the old pass goes before the new one, on its cache where eager
            rows, slots, trees = self.max_batch_size, self.cache_slots, self._trees(first)
            graph = serving_runner(self.model, first, rows, slots, self.compile_config, kv=kv, trees=trees)
            self._graph = graph
        graph.logprobs = None  # until rows that ask for log probabilities join (`Runner.admit`)
        return graph

    def _open(self, group: list[Request]) -> Session | None:
        """The group's rows, prepared to join the runner (which runs their prompt's pass); None where that failed (its
        rows are answered with the error; each alone where a batch of them failed together, the others waiting to
        join on their own)."""
        try:
            session = self._session(group)
        except Exception as error:  # noqa: BLE001 - one bad row must not take the others with it
            if len(group) > 1:
                opened = [s for s in (self._open([request]) for request in group) if s is not None and s.labels]
                for other in opened[1:]:
                    self._waiting[:0] = other.labels
                return opened[0] if opened else None
            self._finish(group[0], error)
            return None
        if self.runner is None:
            self._settings = session.plan.settings.as_kwargs()
        return session

    def _session(self, group: list[Request]) -> Session:
        """`model.mars_rows` over the group, left-padded, each row with its own budget, with the running rows'
        settings where it joins them. Otherwise its settings are resolved for `max_batch_size` rows (a tree that pays
        for a few rows can cost far more than it brings for many; `_choose_tree` re-chooses as rows join and leave),
        from cached pass costs only (a cost not measured yet means plain decoding: `serve` measures in the
        background)."""
        width = max(len(r.input_ids) for r in group)
        ids = torch.full((len(group), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, request in enumerate(group):
            ids[row, width - len(request.input_ids) :] = torch.tensor(request.input_ids)
            mask[row, width - len(request.input_ids) :] = 1
        config = group[0].generation_config.__class__.from_dict(group[0].generation_config.to_dict())
        config.max_new_tokens = max(r.max_new_tokens for r in group)
        config.stop_strings = None
        processors = self._grammars(group)
        config.__dict__.pop("response_format", None)  # each row's own, in `RowGrammars`
        config.__dict__.pop("choices_group", None)  # the engine's to read (`Request.group`), not generate()'s
        config.__dict__.pop("token_logprobs", None)  # the runner records them for every row if one asks
        logprobs = max((r.logprobs for r in group if r.logprobs is not None), default=None)
        config.cache_implementation, config.compile_config = None, None  # the prompt's pass in the runner's cache
        device = self.model.device
        settings = self._settings if self.runner is not None else {}
        if group[0].tau_range is not None:  # its τ is the range's controller, set before every pass
            config.mars_tau = None
            settings = settings or {"mars_tau": self._controller(group[0], len(group))}
        session = self.model.mars_rows(
            ids.to(device),
            attention_mask=mask.to(device),
            generation_config=config,
            labels=group,
            budgets=[r.max_new_tokens for r in group],
            max_rows=self.max_batch_size,
            logits_processor=processors,
            **settings,
        )
        session.separate_prompts()  # requests: each decodes as alone, whoever was opened with it
        session.logprobs = logprobs
        follow_padding(session.plan.processors, session.text.prompt_real)  # where `RowGrammars`' rows begin
        return session

    def _step(self) -> None:
        runner = self.runner
        decoding = runner.decoding
        self.batch_sizes.append(decoding)
        self._choose_tree(runner, decoding)
        tau = self._choose_tau(runner, decoding)
        reach = _reach(runner.plan)
        try:
            runner.step()
            self.metrics.passed(decoding)
        except Exception as error:  # noqa: BLE001 - the rows are answered with it; the server goes on
            logger.exception("a pass failed; its %d rows are answered with the error", len(runner.labels))
            for request in runner.labels:
                self._finish(request, error)
            self.runner = None
            return
        tokens = self._deliver(runner, reach)
        if tau is not None:
            self._policies[self._key].observed(tau, decoding, tokens)
        if not runner.live:
            self.runner = None

    def _trees(self, first: Session) -> tuple:
        """The lossless trees an eager runner for `first`'s rows is built for: each that its settings choose at a power
        of two rows up to `max_batch_size` (and at it), so that `_choose_tree` can re-choose among them as rows join
        and leave. None where they choose one tree at every size, for τ-mode, and
        for a compiled runner (its pass keeps its tree's shape)."""
        request, running = first.labels[0], first.plan.settings
        if self.compile_config is not None or request.tau_range is not None or not running.any_tree:
            return ()
        sizes = [1 << k for k in range(self.max_batch_size.bit_length()) if 1 << k < self.max_batch_size]
        call = {"logits_processor": first.plan.processors}
        try:
            trees = [session_settings(self.model, request.generation_config, rows, call) for rows in sizes]
        except ValueError:
            return ()
        trees = [tree for i, tree in enumerate(trees) if tree != running and tree not in trees[:i]]
        return tuple(trees) if any(tree.verify for tree in (running, *trees)) and trees else ()

    def _choose_tree(self, runner, rows: int) -> None:
        """Lossless rows decode with the draft tree the measured pass costs favour at the rows running now, re-chosen
        whenever their number changes (rows join and leave a few times a request, not every pass): `mars_lossless=
        "auto"` may pay at 1 row with a tree it must drop at 16, and a preset by batch size changes at its own sizes,
        which need not be the cost table's powers of two. A static cache's graph keeps the tree it was built for."""
        if not runner.retrees or self._banded == (id(runner), rows):
            return
        self._banded = (id(runner), rows)
        request, running = runner.labels[0], runner.plan.settings
        if request.tau_range is not None or not running.any_tree:
            return  # τ-mode: no tree
        try:
            call = {"logits_processor": runner.plan.processors}  # a grammar's rows draft chains
            settings = session_settings(self.model, request.generation_config, rows, call)
        except ValueError:
            return
        if settings != running and settings.any_tree:
            try:
                runner.retree(settings)
            except ValueError as error:  # a tree beyond the one a runner was built for: it keeps its own
                logger.info("draft tree at %d rows kept: %s", rows, error)
                return
            self.tree_changes.append((rows, _tree_name(settings)))
            logger.info("draft tree at %d rows: %s", rows, _tree_name(settings))
            self._settings = settings.as_kwargs()

    def _grammars(self, group: list[Request]) -> list:
        """The processors of rows over `group`: a `RowGrammars` where a row of it, or of the running rows it
        joins, follows a schema (each row its own grammar, or none: rows of other schemas, and rows of none, decode
        together); else none, so that plain rows keep their own path."""
        for request in group:
            schema = getattr(request.generation_config, "response_format", None)
            request.grammar = None if schema is None else self._grammar_of(json.dumps(schema, sort_keys=True))
        if all(request.grammar is None for request in group) and _row_grammars(self.runner) is None:
            return []
        from ..grammar import RowGrammars

        processor = RowGrammars(self.tokenizer, eos_token_id=group[0].generation_config.eos_token_id)
        processor.assign([(request, request.grammar) for request in group])
        return [processor]

    @functools.lru_cache(maxsize=64)  # noqa: B019 - the engine lives as long as the server
    def _grammar_of(self, schema: str) -> str:
        """llguidance's grammar of a JSON schema (its JSON text), compiled once per schema."""
        from ..grammar import GrammarProcessor

        return GrammarProcessor.from_json_schema(schema, self.tokenizer).grammar

    def _constrain(self, runner: Runner, joining: Session) -> None:
        """Before `joining`'s rows join `runner` (an eager one): where they follow a grammar and the
        running rows none, the running rows get a `RowGrammars` too (theirs free), as `joining` has one, and their
        lossless drafts become chains (what a grammar's rows draft), from the next pass."""
        if _row_grammars(runner) is not None or _row_grammars(joining) is None:
            return
        from ..grammar import RowGrammars

        processor = RowGrammars(self.tokenizer, eos_token_id=_row_grammars(joining).eos)
        self._processors(runner, [processor])

    def _processors(self, runner: Runner, processors: list) -> None:
        """The runner's rows decode with `processors` from the next pass (their drafts re-chosen for them)."""
        self._banded = None  # `_choose_tree` chooses again, for these processors
        runner.use_processors(LogitsProcessorList(processors))

    def _follow(self, runner: Runner) -> None:
        """The running rows' grammars, in their order (after rows joined or left); a `RowGrammars` whose rows follow
        none any more is dropped (plain rows keep their own path)."""
        processor = _row_grammars(runner)
        if processor is None:
            return
        rows = runner.row_labels  # by row, free ones too
        processor.assign([(request, None if request is None else request.grammar) for request in rows])
        if not processor.constrains and runner.labels and runner.live:
            self._processors(runner, [])

    def _controller(self, request: Request, rows: int) -> TauController:
        """The τ of `request`'s key (one object, so that rows of the key that join later decode with it), set for a
        first pass of `rows` rows: the policy's choice where the key has run before, else the highest τ allowed."""
        lo, hi = request.tau_range
        for old in [key for key in self._controllers if key != self._key][: max(0, len(self._controllers) - 63)]:
            del self._controllers[old]  # keys clients sent once: the oldest go, never the running rows'
            self._policies.pop(old, None)
        controller = self._controllers.setdefault(request.key, TauController(hi))
        policy = self._policies.get(request.key)
        controller.tau = policy.choose(lo, hi, rows, self._queued()).tau if policy else hi
        return controller

    def _choose_tau(self, runner, rows: int) -> float | None:
        """Set the running rows' τ for their next pass, where they allow a range (None where they do not)."""
        request = runner.labels[0] if runner.labels else None
        if request is None or request.tau_range is None:
            return None
        policy = self._policies.get(self._key)
        if policy is None:
            policy = self._policies[self._key] = self._policy(runner)
        lo, hi = request.tau_range
        choice = policy.choose(lo, hi, rows, self._queued())
        controller = self._controllers[self._key]
        if choice.tau != controller.tau:
            logger.info("τ %g -> %g in [%g, %g]: %s", controller.tau, choice.tau, lo, hi, choice.why)
        controller.tau = choice.tau
        for row in runner.labels:
            row.taus.append(choice.tau)
        self.metrics.tau.set(choice.tau)
        self.metrics.pressure.set(choice.pressure)
        return choice.tau

    def _policy(self, runner: Runner) -> TauPolicy:
        """A policy for the runner's rows: where its passes feed what their rows use (eager, on a CPU: `cuts`), τ < 1
        widens a pass (τ = 1 feeds no masks), whose cost it reads from the machine's table (never timing:
        `measure_in_background` does); elsewhere every pass is as wide at any τ."""
        block_size = runner.plan.settings.block_size

        def costs(rows: int):
            try:
                forward = pass_costs(self.model, rows, [1, block_size]).forward
            except NotMeasured:
                return None
            return forward[1], forward[block_size]

        widens = runner.graph.cuts
        return TauPolicy(block_size, self.max_batch_size, costs if widens else None, widens=widens)

    def _deliver(self, runner: Runner, reach: int = 0) -> int:
        """Every row's new tokens to its client; rows that stopped (or whose client left) are released and
        answered. Returns how many tokens were sent. `reach`: the tokens the pass could accept beyond each row's own
        (the metrics' drafts; 0 for a prompt's pass)."""
        stopped, now, sent_in_all = [], time.monotonic(), 0
        scored = _scored(runner)
        for i, (request, tokens, done, passes) in enumerate(runner.rows()):
            sent = len(request.generated)
            row_scored = scored(i) if request.scoring is not None else None
            ended = request.take(tokens, row_scored) or done or request.sink.cancelled.is_set()
            self.metrics.delivered(request, len(request.generated) - sent, now, reach)
            sent_in_all += len(request.generated) - sent
            if ended:
                request.forward_passes = passes
                stopped.append(request)
        if stopped:
            runner.release(stopped)
            self._follow(runner)  # rows left, a runner's moved
            for request in stopped:
                self._finish(request)
        return sent_in_all

    def _finish(self, request: Request, error: Exception | None = None) -> None:
        passes = max(request.forward_passes, 1)
        self._usage[request.request_id] = {
            "forward_passes": request.forward_passes,
            "tokens_per_forward": round(len(request.generated) / passes, 4),
        }
        if request.taus:  # a τ range: the τ its passes ran at (its prompt's pass aside)
            taus = request.taus
            summary = {"mean": sum(taus) / len(taus), "min": min(taus), "max": max(taus)}
            self._usage[request.request_id]["mars_tau"] = {k: round(v, 4) for k, v in summary.items()}
        cancelled = request.sink.cancelled.is_set()
        self.metrics.finished(request, "error" if error is not None else "cancelled" if cancelled else "stop")
        self.finished.append(
            {"request_id": request.request_id, "tokens": len(request.generated), "cancelled": cancelled}
        )
        while len(self._usage) > 4096:  # a client that left never reads its usage
            self._usage.popitem(last=False)
        request.sink.finish(request, error)


def _row_grammars(rows):
    """The `RowGrammars` of `rows` (a runner, or rows prepared to join it), or None (none running, or rows that
    follow no grammar)."""
    if rows is None:
        return None
    return next((p for p in rows.plan.processors if type(p).__name__ == "RowGrammars"), None)


def _scored(runner):
    """Row `i`'s (its place in the batch) log probabilities of its tokens from the last pass, `[(logprob, top values,
    top ids)]`, as a function; none where the pass recorded none (`Runner.logprobs`). Read once a pass."""
    scored, runner.scored = runner.scored, None
    if scored is None:
        return lambda i: None
    fed, chosen, values, ids = scored
    place = {row: p for p, row in enumerate(fed.tolist())}
    chosen = chosen.tolist()
    values, ids = (None, None) if values is None else (values.tolist(), ids.tolist())

    def of(i: int):
        p = place.get(i)
        if p is None:
            return None
        tops = [(None, None)] * len(chosen[p]) if values is None else list(zip(values[p], ids[p]))
        return [(logprob, *top) for logprob, top in zip(chosen[p], tops)]

    return of


def _reach(plan) -> int:
    """The tokens a pass of `plan`'s rows can accept beyond each row's own: τ-mode's B-1 masks, lossless mode's draft
    tree's depth, none at τ = 1."""
    settings = plan.settings
    if settings.verify:
        return full_tree(settings.block_size - 1, plan.candidates, plan.lookup).depth
    return 0 if settings.tau == 1.0 else settings.block_size - 1


def _tree_name(settings) -> str:
    if not settings.verify:
        return "none (plain decoding)"
    return tree_key(settings.block_size, settings.draft_candidates, settings.lookup)


def _time_every_band(model, max_batch_size: int) -> bool:
    """`measure_in_background`'s timing, once: False where the timer declined some of it (the machine was busy)."""
    forget_declined()
    measure(model, [max_batch_size], mars_verify=True)
    bands = [1 << k for k in range(cost_batch(max_batch_size).bit_length())][::-1]
    measure(model, bands, mars_verify=True)
    block = getattr(model.config, "mars_block_size", None)
    try:
        for rows in bands if block else []:
            time_pass_costs(model, rows, [1, block])
    except NotMeasured:
        return False
    return not declined()


def measure_in_background(model, max_batch_size: int, idle=lambda: True, retry_s: float = RETRY_S):
    """Resolve lossless mode's tree for `max_batch_size` rows, the size every runner's settings are chosen for, in
    a thread of its own: with `mars_lossless="auto"` on a machine that has not cached its pass costs this times
    them (in seconds), while the server already answers (its lossless requests draft as what is known of this kind
    of device says until then: `costs.prior_costs`), then at every smaller batch size the running rows meet (powers
    of two: the engine re-chooses the tree as rows join and leave), and there the one-token and B-token passes that
    the τ policy of requests with a τ range reads. Where other work held the CPU (the timer declined), it tries
    again every `retry_s` seconds at which the server is `idle` (no row decoding: its own work would disturb the
    timing as another process's does), until the costs are timed: the work a long-running server is started for
    pays for the timing once."""

    def run() -> None:
        started = time.monotonic()
        logger.info("pass costs at batch %d: timing in the background (a prior chooses until then)", max_batch_size)
        while not _time_every_band(model, max_batch_size):
            logger.info("pass costs: the machine is busy; trying again in %.0f s once the server is idle", retry_s)
            time.sleep(retry_s)
            while not idle():
                time.sleep(retry_s)
        logger.info("pass costs ready (%.0f s)", time.monotonic() - started)

    thread = threading.Thread(target=run, name="mars-costs", daemon=True)
    thread.start()
    return thread
