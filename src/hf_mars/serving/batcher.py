"""Many requests, one `generate()` call: the server's batcher.

Requests wait in a queue; one inference thread takes the oldest, gathers every queued request that decodes with the
same settings (sampling, stop strings, MARS mode and tree: one `generate()` call takes one set), up to
`max_batch_size`, left-pads them into one batch and runs `model.generate()` once. MARS decodes ragged batches
exactly (batched rows equal unbatched ones), each row retiring on its own stop, so a request's text does not depend
on what it was batched with.

Each row's stop is judged by one stopping criterion, `RowStops`, which holds all of it: the row's own `max_tokens`,
EOS, its stop strings, and whether its client went away. `generate()` calls a criterion once per step for the whole
batch (MARS makes the same calls: `decoding/stopping.py`), so the criterion is also where each row's settled tokens
are handed to its client, in order, and nothing after its stop. A client that disconnects stops its row at the next
step; a finished row leaves MARS's dynamic cache and costs nothing more.

Requests that arrive while a batch runs wait for the next one: MARS's cache is built per `generate()` call, so rows
do not join a batch already decoding (docs/serving.md).
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.cli.serving.utils import BaseGenerateManager, DirectStreamer, _StreamError
from transformers.generation.stopping_criteria import StopStringCriteria

# A request's stop is `RowStops`' to judge; these keys of its generation config go into that criterion instead.
_PER_ROW_KEYS = ("max_new_tokens", "stop_strings")


@dataclass
class Request:
    """One client's generation: its prompt, its own limits, and where its tokens go."""

    request_id: str
    input_ids: list[int]
    generation_config: object
    max_new_tokens: int
    sink: RowSink
    stop_strings: list[str] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    done: bool = False
    forward_passes: int = 0

    @property
    def key(self) -> str:
        """Requests with equal keys decode in one `generate()` call: same sampling and MARS settings."""
        config = self.generation_config.to_dict()
        for name in _PER_ROW_KEYS:
            config.pop(name, None)
        return json.dumps(config, sort_keys=True, default=str)


class RowSink:
    """Where one row's tokens go: a `DirectStreamer` (transformers serve's incremental detokenizer feeding the SSE
    queue) for a streaming client, or a future resolved with all tokens for a non-streaming one. `cancel()` is what
    the handler calls when the client disconnects."""

    def __init__(self, loop, streamer: DirectStreamer | None = None, queue=None, future: asyncio.Future | None = None):
        self.loop, self.streamer, self.queue, self.future = loop, streamer, queue, future
        self.cancelled = threading.Event()
        self.total_tokens = 0

    def cancel(self) -> None:
        self.cancelled.set()

    def put(self, token_id: int) -> None:
        self.total_tokens += 1
        if self.streamer is not None:
            self.streamer.put(torch.tensor([token_id]))

    def finish(self, request: Request, error: Exception | None = None) -> None:
        """The row is over: the stream's end (or the future's result) is signalled last, after the batcher has
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


class RowStops(StoppingCriteria):
    """Each row's whole stopping rule, judged once per step, and the hand-off of the row's tokens to its client.

    Holding every rule (not only some, beside `generate()`'s own) is what lets it know which rows are over: a row
    stops at EOS, at its own `max_tokens`, at one of its stop strings, or when its client cancelled."""

    def __init__(self, requests: list[Request], prompt_length: int, eos_token_ids: set[int], tokenizer):
        self.requests, self.prompt_length, self.eos = requests, prompt_length, eos_token_ids
        self.stop_strings = [
            StopStringCriteria(tokenizer, r.stop_strings) if r.stop_strings else None for r in requests
        ]

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        step = input_ids.shape[1] - self.prompt_length
        tokens = input_ids[:, -1].tolist()
        for row, request in enumerate(self.requests):
            if request.done:
                continue
            if request.sink.cancelled.is_set():
                request.done = True
                continue
            request.generated.append(tokens[row])
            request.sink.put(tokens[row])
            request.done = (
                tokens[row] in self.eos or step >= request.max_new_tokens or self._stop_string(row, input_ids)
            )
        return torch.tensor([r.done for r in self.requests], device=input_ids.device)

    def _stop_string(self, row: int, input_ids: torch.LongTensor) -> bool:
        criterion = self.stop_strings[row]
        return criterion is not None and bool(criterion(input_ids[row : row + 1], None)[0])


class MARSBatcher(BaseGenerateManager):
    """transformers serve's generation manager, batching: the handlers call `generate_streaming` and
    `generate_non_streaming` as they call its sequential `GenerateManager`; this one queues the request and returns,
    and its inference thread decodes queued requests together."""

    def __init__(self, model, tokenizer, max_batch_size: int = 8):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        self.model, self.tokenizer, self.max_batch_size = model, tokenizer, max_batch_size
        self.batch_sizes: list[int] = []  # every batch decoded so far, for tests and logs
        self._usage: OrderedDict[str, dict] = OrderedDict()  # finished rows' passes, until the handler reads them
        self.finished: deque[dict] = deque(maxlen=1024)  # the last rows decoded: what they took, whether cancelled
        self._queue: queue.Queue[Request | None] = queue.Queue()
        self._waiting: list[Request] = []
        self._thread = threading.Thread(target=self._serve, name="mars-batcher", daemon=True)
        self._thread.start()

    # -- the handlers' side (event loop) --

    def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
        loop = asyncio.get_running_loop()
        text_queue: asyncio.Queue = asyncio.Queue()
        rust_tokenizer = getattr(processor, "tokenizer", processor)._tokenizer
        streamer = DirectStreamer(rust_tokenizer, loop, text_queue, response_parser=response_parser)
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
        text = processor.decode(generated, skip_special_tokens=True)
        return text, inputs["input_ids"].shape[-1], generated

    def usage(self, request_id: str) -> dict | None:
        """A finished request's MARS usage (`forward_passes`, `tokens_per_forward`), read once by the handler."""
        return self._usage.pop(request_id, None)

    def submit(self, request_id: str, inputs, gen_config, sink: RowSink) -> None:
        input_ids = inputs["input_ids"]
        if input_ids.shape[0] != 1:
            raise ValueError("one prompt per request")
        stop = gen_config.stop_strings
        request = Request(
            request_id=request_id,
            input_ids=input_ids[0].tolist(),
            generation_config=gen_config,
            max_new_tokens=gen_config.max_new_tokens,
            sink=sink,
            stop_strings=[stop] if isinstance(stop, str) else list(stop or []),
        )
        self._queue.put(request)

    def stop(self) -> None:
        self._queue.put(None)

    # -- the inference thread --

    def _serve(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._decode(batch)

    def _next_batch(self) -> list[Request] | None:
        """The oldest waiting request and every other waiting one with its key, up to `max_batch_size`."""
        if not self._waiting:
            first = self._queue.get()
            if first is None:
                return None
            self._waiting.append(first)
        while True:  # everything that has arrived meanwhile
            try:
                request = self._queue.get_nowait()
            except queue.Empty:
                break
            if request is None:
                return None
            self._waiting.append(request)
        key = self._waiting[0].key
        batch = [r for r in self._waiting if r.key == key and not r.sink.cancelled.is_set()][: self.max_batch_size]
        self._waiting = [r for r in self._waiting if r not in batch and not r.sink.cancelled.is_set()]
        return batch or self._next_batch()

    def _decode(self, batch: list[Request]) -> None:
        self.batch_sizes.append(len(batch))
        try:
            self._generate(batch)
        except Exception as error:  # noqa: BLE001 - one bad row must not take the others with it
            if len(batch) > 1 and not any(r.generated for r in batch):
                for request in batch:
                    self._decode([request])
                return
            for request in batch:
                request.sink.finish(request, error)
            return
        for request in batch:
            self._record_usage(request)
            request.sink.finish(request)

    def _record_usage(self, request: Request) -> None:
        passes = max(request.forward_passes, 1)
        self._usage[request.request_id] = {
            "forward_passes": request.forward_passes,
            "tokens_per_forward": round(len(request.generated) / passes, 4),
        }
        cancelled = request.sink.cancelled.is_set()
        self.finished.append(
            {"request_id": request.request_id, "tokens": len(request.generated), "cancelled": cancelled}
        )
        while len(self._usage) > 4096:  # a client that left never reads its usage
            self._usage.popitem(last=False)

    @torch.inference_mode()
    def _generate(self, batch: list[Request]) -> None:
        """One `generate()` call over the batch, left-padded; the rows' tokens leave through `RowStops`."""
        width = max(len(r.input_ids) for r in batch)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, request in enumerate(batch):
            ids[row, width - len(request.input_ids) :] = torch.tensor(request.input_ids)
            mask[row, width - len(request.input_ids) :] = 1
        config = _batch_config(batch)
        stops = RowStops(batch, width, _eos_ids(config, self.model), self.tokenizer)
        device = self.model.device
        out = self.model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([stops]),
        )
        stats = getattr(out, "mars_stats", None)
        for row, request in enumerate(batch):
            passes = stats.passes_per_row[row].item() if stats is not None else len(request.generated)
            request.forward_passes = int(passes)


def _batch_config(batch: list[Request]):
    """The batch's generation config: the rows' shared settings, the longest row's budget; each row's own budget and
    stop strings are `RowStops`'."""
    config = batch[0].generation_config.__class__.from_dict(batch[0].generation_config.to_dict())
    config.max_new_tokens = max(r.max_new_tokens for r in batch)
    config.stop_strings = None
    config.return_dict_in_generate = True
    return config


def _eos_ids(config, model) -> set[int]:
    eos = config.eos_token_id if config.eos_token_id is not None else model.generation_config.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
