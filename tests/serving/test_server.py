"""`hf-mars serve` on loopback: a tiny random MARS checkpoint, the openai client, many requests at once.

The texts are checked against offline `generate()` on a second copy of the checkpoint, so a request that received
another request's tokens, or lost its own, fails."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch
from helpers import make_model, make_tokenizer, rows_invariant_linear, serving
from openai import AsyncOpenAI, BadRequestError, OpenAI
from tokenizers.decoders import DecodeStream
from transformers import AutoModelForCausalLM

from hf_mars import to_mars

uvicorn = pytest.importorskip("uvicorn")

MODES = {"tau=1": {"mars_tau": 1.0}, "lossless": {"mars_verify": True}, "tau=0.9": {"mars_tau": 0.9}}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server on a free loopback port, its engine, the checkpoint's path, and an offline copy of the model: rows in
    the engine's eager runner, over a static cache of 640 slots per row (`--cache-slots`), which compacts often."""
    from hf_mars.serving.server import build_app

    path = str(tmp_path_factory.mktemp("served"))
    # llama: transformers serve parses Qwen chat replies with a response template, which keeps special tokens in the
    # stream; a model without one streams what `decode(skip_special_tokens=True)` gives, which the tests compare
    tok, model = make_tokenizer(), make_model("llama")
    to_mars(model, tok, block_size=4)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    app, engine = build_app(path, dtype="float32", device="cpu", max_batch_size=16, cache_slots=640)
    offline = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
    with serving(app) as url:
        yield {"url": url, "engine": engine, "path": path, "offline": offline, "tok": tok}


def _long_stream(server, max_tokens: int, **mars) -> dict:
    """A streamed request that decodes until its budget (the random model rarely says EOS)."""
    messages = [{"role": "user", "content": "count forever"}]
    return {"model": server["path"], "messages": messages, "max_tokens": max_tokens, "stream": True, **mars}


def _batched(server, requests: list) -> list:
    """The results of these client coroutines, run at once, once the engine is seen to have batched some of them."""

    async def together():
        return await asyncio.gather(*requests)

    engine = server["engine"]
    before = len(engine.batch_sizes)
    results = asyncio.run(together())
    assert max(engine.batch_sizes[before:]) > 1, "concurrent requests were not batched"
    return results


def _client(server) -> OpenAI:
    return OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def _offline(server, content: str, mode: dict, max_tokens: int = MAX_TOKENS) -> tuple[str, int]:
    """What `generate()` gives this prompt alone, as the server's chat handler tokenizes it, detokenized as a stream
    is (token by token: a character whose bytes the budget cuts is not sent)."""
    tok, model = server["tok"], server["offline"]
    messages = [{"role": "user", "content": content}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    if mode.get("mars_tau") == 1.0 or mode.get("mars_verify"):
        mode = {}  # τ = 1 and lossless mode must give plain greedy generate()'s text
    out = model.generate(**ids, do_sample=False, max_new_tokens=max_tokens, **mode)
    stream = DecodeStream([], skip_special_tokens=True)
    tokens = out[0, ids["input_ids"].shape[1] :].tolist()
    pieces = [stream.step(tok._tokenizer, token) for token in tokens]
    return "".join(piece for piece in pieces if piece is not None), len(tokens)


def _ask(url: str, model: str, content: str, delay: float = 0.0, max_tokens: int = MAX_TOKENS, **fields):
    """One streamed chat request after `delay` seconds: `(text, usage)`."""

    async def run():
        await asyncio.sleep(delay)
        async with AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120) as client:
            chunks = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": content}],
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                extra_body=fields,
            )
            parts, usage = [], None
            async for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
                usage = chunk.usage or usage
        return "".join(parts), usage

    return run()


def test_lists_the_model_and_is_healthy(server):
    assert [m.id for m in _client(server).models.list().data] == [Path(server["path"]).name]
    assert httpx.get(server["url"] + "/health").json() == {"status": "ok"}


def test_32_streams_arriving_staggered_with_mixed_settings_each_get_their_own_text(server):
    """Clients arrive one every few milliseconds, so rows join the running batch between its passes."""
    jobs = [(f"count {i} to {i + 9}", name) for i in range(32) for name in [list(MODES)[i % 3]]]

    url, model, engine = server["url"], server["path"], server["engine"]
    results = _batched(server, [_ask(url, model, c, 0.02 * i, **MODES[m]) for i, (c, m) in enumerate(jobs)])
    assert engine._graph is not None, "the runner must have served"
    for (content, mode), (text, usage) in zip(jobs, results):
        assert (text, usage.completion_tokens) == _offline(server, content, MODES[mode]), (content, mode)
        assert 1 <= usage.forward_passes <= usage.completion_tokens
        assert usage.tokens_per_forward == pytest.approx(usage.completion_tokens / usage.forward_passes, abs=1e-3)


def test_concurrent_requests_with_a_frequency_penalty_each_get_their_own_penalised_text(server):
    """transformers serve maps `frequency_penalty` f to a repetition penalty of 1 + f; rows that join the running
    batch (with `--cache-slots`, the graph pass's rows) each get greedy `generate()`'s text with that penalty."""

    async def ask(content: str, delay: float):
        await asyncio.sleep(delay)
        async with AsyncOpenAI(base_url=server["url"] + "/v1", api_key="-", max_retries=0, timeout=120) as client:
            chunks = await client.chat.completions.create(
                model=server["path"], messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS,
                temperature=0, frequency_penalty=0.5, extra_body={"mars_verify": True}, stream=True,
            )  # fmt: skip
            parts, usage = [], None
            async for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
                usage = chunk.usage or usage
        return "".join(parts), usage.completion_tokens

    replies = _batched(server, [ask(f"say {i} {i} {i} again", 0.02 * i) for i in range(8)])
    changed = False
    for i, reply in enumerate(replies):
        content = f"say {i} {i} {i} again"
        assert reply == _offline(server, content, {"repetition_penalty": 1.5}), i
        changed |= reply != _offline(server, content, {})
    assert changed, "the penalty must change some text"


def test_logit_bias_bars_a_token_in_every_row(server):
    """OpenAI's `logit_bias` (a `sequence_bias` of single tokens), sent as clients send it (an integer bias by a token
    id string), on chat requests decoding together: each gets greedy `generate()`'s text with that bias (with
    `--cache-slots`, in the graph pass's rows); and on `/v1/completions`. The barred token is one the model writes for
    these prompts, so that the bias changes the text."""
    contents = [f"count {i} to {i + 5}" for i in range(4)]
    tok, model = server["tok"], server["offline"]
    written = []
    for content in contents:
        messages = [{"role": "user", "content": content}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        written += model.generate(**ids, do_sample=False, max_new_tokens=MAX_TOKENS)[0, ids["input_ids"].shape[1] :]
    barred = max(set(int(t) for t in written), key=[int(t) for t in written].count)

    async def ask(content: str, delay: float):
        await asyncio.sleep(delay)
        async with AsyncOpenAI(base_url=server["url"] + "/v1", api_key="-", max_retries=0, timeout=120) as client:
            chunks = await client.chat.completions.create(
                model=server["path"], messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS,
                temperature=0, logit_bias={str(barred): -100}, extra_body={"mars_verify": True}, stream=True,
            )  # fmt: skip
            parts = [chunk.choices[0].delta.content async for chunk in chunks if chunk.choices]
        return "".join(part for part in parts if part)

    replies = _batched(server, [ask(content, 0.02 * i) for i, content in enumerate(contents)])
    changed = False
    for content, reply in zip(contents, replies):
        biased, _ = _offline(server, content, {"sequence_bias": {(barred,): -100.0}})
        assert reply == biased, content
        changed |= reply != _offline(server, content, {})[0]
    assert changed, "the bias must change some text"
    prompt = "<|im_start|>user\ncount 1 to 6<|im_end|>\n<|im_start|>assistant\n"  # /v1/completions
    ids = tok(prompt, return_tensors="pt")
    plain = model.generate(**ids, do_sample=False, max_new_tokens=MAX_TOKENS)[0, ids["input_ids"].shape[1] :].tolist()
    barred = max(set(plain), key=plain.count)
    reply = _client(server).completions.create(
        model=server["path"], prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logit_bias={str(barred): -100}
    )
    out = model.generate(**ids, do_sample=False, max_new_tokens=MAX_TOKENS, sequence_bias={(barred,): -100.0})
    new = out[0, ids["input_ids"].shape[1] :]
    assert reply.choices[0].text == tok.decode(new, skip_special_tokens=True)
    assert new.tolist() != plain, "the bias must change the text"


def test_a_request_that_admission_fails_on_is_answered_and_the_next_is_served(server, monkeypatch):
    """A request whose admission raises (here its settings' key, as a `logit_bias` once made it) gets the error, and
    the requests after it, which wait for the oldest, are served: the engine never wedges on one request."""
    from hf_mars.serving.engine import Request

    key = Request.key.fget

    def poisoned(request):  # a request with a budget of 3 tokens
        if request.max_new_tokens == 3:
            raise RuntimeError("poisoned settings")
        return key(request)

    monkeypatch.setattr(Request, "key", property(poisoned))
    body = {"model": server["path"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    response = httpx.post(server["url"] + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code != 200 or "poisoned settings" in response.text
    reply = _client(server).chat.completions.create(
        model=server["path"], messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert reply.choices[0].message.content is not None


def test_a_row_too_long_for_the_runners_cache_decodes_apart_and_the_rows_that_came_with_it_in_the_runner(
    tmp_path, monkeypatch
):
    """With `--cache-slots`, requests that arrive together join the runner as one group: one whose prompt and
    max_tokens need more slots than the cache has decodes apart, in an eager runner of its own, sized for it, once the
    runner's rows are done (`MARSEngine._beyond_slots`, `_graph_for`), and the others, tried alone, in the runner: each
    gets greedy `generate()`'s text, the long one too."""
    from hf_mars.serving.engine import MARSEngine
    from hf_mars.serving.server import build_app

    tok, model = make_tokenizer(), make_model("llama")
    to_mars(model, tok, block_size=4)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    app, engine = build_app(str(tmp_path), dtype="float32", device="cpu", max_batch_size=4, cache_slots=96)
    admit, groups = MARSEngine._admit, []

    def together(self):  # the first admission waits until all four have arrived: one group
        if not groups and len(self._waiting) < 4:
            return time.sleep(0.01)
        groups.append(len(self._waiting))
        return admit(self)

    beyond, apart = MARSEngine._beyond_slots, []
    monkeypatch.setattr(MARSEngine, "_admit", together)
    monkeypatch.setattr(MARSEngine, "_beyond_slots", lambda self, j: beyond(self, j) and not apart.append(j.labels[0]))
    graph_for, runners = MARSEngine._graph_for, []

    def built(self, first):
        runners.append(graph_for(self, first))
        return runners[-1]

    monkeypatch.setattr(MARSEngine, "_graph_for", built)
    budgets = [8, 200, 8, 8]  # the second's prompt and budget exceed the 96 slots

    async def ask(content: str, budget: int):
        async with AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120) as client:
            reply = await client.chat.completions.create(
                model=str(tmp_path), messages=[{"role": "user", "content": content}], max_tokens=budget,
                temperature=0, extra_body={"mars_verify": True},
            )  # fmt: skip
            return reply.choices[0].message.content

    contents = [f"count {i} to {i + 5}" for i in range(4)]
    with serving(app) as url:

        async def run():
            return await asyncio.gather(*(ask(c, b) for c, b in zip(contents, budgets)))

        replies = asyncio.run(run())
    assert groups[0] == 4, "the premise: the four joined as one group"
    assert [request.max_new_tokens for request in apart] == [200], "the long one alone went apart"
    assert engine._graph is not None and engine._graph.shape.slots == 96, "the others decoded in the runner"
    alone = [runner for runner in runners if runner is not engine._graph]
    assert [(r.shape.batch, r.shape.slots > 96) for r in alone] == [(1, True)], "the long one in a runner of its own"
    offline = AutoModelForCausalLM.from_pretrained(str(tmp_path), trust_remote_code=True, dtype=torch.float32)
    for content, budget, reply in zip(contents, budgets, replies):
        ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)  # fmt: skip
        out = offline.generate(**ids, do_sample=False, max_new_tokens=budget)[0, ids["input_ids"].shape[1] :]
        assert reply == tok.decode(out, skip_special_tokens=True), content


def test_the_model_is_listed_and_answered_under_its_folder_s_name_not_its_path(server):
    """`/v1/models` names a local checkpoint as a user would (its folder's name); requests may ask for it by that name
    or by the path transformers serve takes, and answers name it by that name."""
    from hf_mars.serving.server import served_model_name

    name = Path(server["path"]).name
    assert served_model_name(server["path"]) == name and served_model_name("someone/model") == "someone/model"
    listed = httpx.get(server["url"] + "/v1/models", timeout=30).json()["data"]
    assert [entry["id"] for entry in listed] == [name]
    for asked in (name, server["path"]):
        reply = _client(server).chat.completions.create(
            model=asked, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert reply.model == name
    refused = httpx.post(
        server["url"] + "/v1/chat/completions",
        json={"model": "someone/else", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=30,
    )
    assert refused.status_code == 400


def test_completions_read_mars_settings_from_the_generation_config_string(server):
    prompt = "<|im_start|>user\ncount 3 to 9<|im_end|>\n<|im_start|>assistant\n"
    reply = _client(server).completions.create(
        model=server["path"],
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        extra_body={"generation_config": '{"mars_verify": true, "do_sample": false}'},
    )
    tok, model = server["tok"], server["offline"]
    ids = tok(prompt, return_tensors="pt")
    out = model.generate(**ids, do_sample=False, max_new_tokens=MAX_TOKENS)
    assert reply.choices[0].text == tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert reply.usage.forward_passes <= reply.usage.completion_tokens


@pytest.mark.parametrize("minimum", ["min_new_tokens", "min_length"])
def test_a_minimum_length_in_the_generation_config_holds_each_row_as_alone(server, minimum):
    """`min_new_tokens` (or `min_length`, which counts the prompt) in the `generation_config` string, for prompts of
    several lengths decoding together (with `--cache-slots`, in the graph pass's rows, each from column 0): each row
    is held to its own minimum, as `generate()` holds its prompt alone, whether it was opened with the others (left
    padded to the longest) or joined them. Its EOS is a token the model soon decodes, so the minimum matters."""
    import json

    tok, model = server["tok"], server["offline"]
    prompts = [f"<|im_start|>user\ncount {'and ' * i}on<|im_end|>\n<|im_start|>assistant\n" for i in range(4)]
    ids = [tok(prompt, return_tensors="pt") for prompt in prompts]
    greedy = dict(do_sample=False, max_new_tokens=MAX_TOKENS)
    stop = int(model.generate(**ids[0], **greedy)[0, ids[0]["input_ids"].shape[1] + 3])
    shortest = ids[0]["input_ids"].shape[1]  # padded to a longer prompt, it would count fewer new tokens as due
    rule, greedy = {minimum: 8 if minimum == "min_new_tokens" else shortest + 8}, dict(greedy, eos_token_id=stop)
    config = json.dumps({"mars_verify": True, "do_sample": False, "eos_token_id": stop, **rule})

    async def ask(prompt: str):
        async with AsyncOpenAI(base_url=server["url"] + "/v1", api_key="-", max_retries=0, timeout=120) as client:
            reply = await client.completions.create(
                model=server["path"], prompt=prompt, max_tokens=MAX_TOKENS, extra_body={"generation_config": config}
            )
        return reply.choices[0].text

    texts = _batched(server, [ask(prompt) for prompt in prompts])
    held = False
    for prompt_ids, text in zip(ids, texts):
        start = prompt_ids["input_ids"].shape[1]
        alone = model.generate(**prompt_ids, **greedy, **rule)[0, start:]
        assert text == tok.decode(alone, skip_special_tokens=True)
        held |= not torch.equal(alone, model.generate(**prompt_ids, **greedy)[0, start:])
    assert held, "the minimum must hold some request past its EOS"


def test_a_client_that_disconnects_frees_its_row(server):
    """The row of a client that leaves mid-stream is released, cancelled, before its budget. Its prompt is one whose
    greedy text runs past the budget (the random model's reply to "count forever" ends at 420 tokens), so that the
    row is still decoding, for as long as it can, when the server sees the client go."""
    engine = server["engine"]
    body = _long_stream(server, 480, mars_verify=True)
    body["messages"] = [{"role": "user", "content": "say nothing"}]
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server["url"] + "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            request_id = response.headers["x-request-id"]
            for n, _ in enumerate(response.iter_lines()):
                if n >= 3:
                    break
    deadline = time.monotonic() + 60
    while not any(row["request_id"] == request_id for row in engine.finished):
        assert time.monotonic() < deadline, "the disconnected row was never released"
        time.sleep(0.05)
    row = next(row for row in engine.finished if row["request_id"] == request_id)
    assert row["cancelled"] and row["tokens"] < 480, row
    reply = _client(server).chat.completions.create(
        model=server["path"], messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert reply.usage.completion_tokens == 4


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"mars_tau": 2}, "mars_tau must be a number in [0, 1]"),
        ({"mars_verify": "yes"}, "mars_verify must be True or False"),
        ({"max_tokens": -1}, "max_tokens must be an integer in [1, 512]"),
        ({"max_tokens": 10**9}, "max_tokens must be an integer in [1, 512]"),
        ({"model": "someone/else"}, "Server is pinned to"),
        ({"mars_draft_candidates": 3}, "mars_draft_candidates"),
        ({"mars_tau": [1.0, 0.5]}, "or a range [lo, hi] with 0 <= lo <= hi <= 1"),
        ({"mars_tau": [0.5]}, "or a range [lo, hi]"),
        ({"mars_tau": [0.5, 1.0], "mars_verify": True}, "mars_tau as a range is for τ-mode"),
        ({"logit_bias": {"999999": -100}}, "'999999' is not a token id of this model"),
        ({"logit_bias": {"x": 1}}, "'x' is not a token id"),
        ({"logit_bias": {"5": 101}}, "bias must be a number in [-100, 100]"),
    ],
)
def test_invalid_requests_get_a_400_with_the_reason_and_the_server_goes_on(server, fields, reason):
    body = {"model": server["path"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    response = httpx.post(server["url"] + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert reason in response.json()["detail"]
    assert (
        _client(server)
        .chat.completions.create(model=server["path"], messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        .choices[0]
        .message.content
        is not None
    )


@pytest.mark.parametrize(
    ("endpoint", "fields"),
    [
        ("chat", {"presence_penalty": 0.5}),
        ("completions", {"echo": True}),
        ("completions", {"suffix": "x"}),
    ],
)
def test_openai_fields_it_cannot_honour_are_refused_by_name(server, endpoint, fields):
    """transformers serve ignores these (one choice for n = 2, `logprobs: null`, no prompt for `echo`, the suffix
    appended to the answer): each is a 400 naming the field and why, and the server goes on."""
    base = {"model": server["path"], "max_tokens": 2}
    base |= {"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat" else {"prompt": "hi"}
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    response = httpx.post(server["url"] + path, json={**base, **fields}, timeout=60)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert all(f"{key}={value!r} is not supported" in message for key, value in fields.items()), message
    harmless = {"n": 1, "logprobs": False, "top_logprobs": 0, "presence_penalty": 0.0, "user": "me"}
    if endpoint == "completions":
        harmless = {"n": 1, "best_of": 1, "echo": False, "suffix": "", "user": "me"}
    reply = httpx.post(server["url"] + path, json={**base, **harmless}, timeout=60)
    assert reply.status_code == 200, reply.text  # the values that ask for nothing are served as before
    if fields == {"presence_penalty": 0.5}:  # what the openai client raises
        with pytest.raises(BadRequestError, match="presence_penalty=0.5 is not supported"):
            _client(server).chat.completions.create(**base | fields)


# Bounded (a short enum, a small integer, short strings, little whitespace): a random model's output ends within the
# budget, so it must parse
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["answer", "count", "note"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_pattern": "[ ]{0,1}"},
}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}}


def _offline_constrained(server, content: str, max_tokens: int, schema: dict | None = SCHEMA) -> str:
    """Plain constrained greedy `generate()` of this prompt alone (`schema` None: unconstrained), as the chat handler
    tokenizes it, decoded whole, as a reply that is not streamed."""
    from hf_mars.grammar import GrammarProcessor

    tok, model = server["tok"], server["offline"]
    messages = [{"role": "user", "content": content}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    eos = model.generation_config.eos_token_id
    grammar = [] if schema is None else [GrammarProcessor.from_json_schema(schema, tok, eos_token_id=eos)]
    out = model.generate(**ids, do_sample=False, max_new_tokens=max_tokens, logits_processor=grammar)
    return tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_json_schema_response_format_is_followed_by_every_mode_and_lossless_keeps_constrained_greedy(server, stream):
    """`response_format` with a JSON schema, through the openai client: every mode's text validates, lossless mode's
    and τ = 1's are plain constrained greedy `generate()`'s; requests of one schema decode batched. With
    `--cache-slots` too: the eager runner's pass calls the grammar on each slot's text (`GraphShape.calls`)."""
    client, prompts = _client(server), ["hi", "count to three", "say no"]

    def ask(content: str, mode: dict) -> str:
        fields = dict(model=server["path"], messages=[{"role": "user", "content": content}], max_tokens=160)
        reply = client.chat.completions.create(**fields, response_format=JSON_FORMAT, stream=stream, extra_body=mode)
        if not stream:
            return reply.choices[0].message.content
        return "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)

    for mode in MODES.values():
        for content in prompts:
            text = ask(content, mode)
            jsonschema.validate(json.loads(text), SCHEMA)
            if mode.get("mars_verify") or mode.get("mars_tau") == 1.0:
                assert text == _offline_constrained(server, content, 160)


def test_sixteen_clients_half_with_a_schema_each_get_their_own_valid_text(server):
    """Requests with and without a schema at once: they decode in one batch (each row its own grammar, or none),
    every schema text is lossless mode's constrained greedy one, every other text greedy's own; on the eager runner
    too (`--cache-slots`), whose pass calls the rows' grammars."""
    prompts = [f"item {i}" for i in range(8)]

    async def ask(content: str, constrained: bool) -> str:
        async with AsyncOpenAI(base_url=server["url"] + "/v1", api_key="-", max_retries=0, timeout=300) as client:
            reply = await client.chat.completions.create(
                model=server["path"],
                messages=[{"role": "user", "content": content}],
                max_tokens=160 if constrained else MAX_TOKENS,
                extra_body={"mars_verify": True},
                **({"response_format": JSON_FORMAT} if constrained else {}),
            )
        return reply.choices[0].message.content

    async def together():
        return await asyncio.gather(*(ask(p, c) for p in prompts for c in (True, False)))

    engine, before = server["engine"], len(server["engine"].batch_sizes)
    texts = asyncio.run(together())
    assert max(engine.batch_sizes[before:]) > len(prompts)  # rows of a schema and of none in one batch
    for i, content in enumerate(prompts):
        constrained, plain = texts[2 * i], texts[2 * i + 1]
        assert constrained == _offline_constrained(server, content, 160)
        jsonschema.validate(json.loads(constrained), SCHEMA)
        assert plain == _offline_constrained(server, content, MAX_TOKENS, schema=None)


def test_rows_of_other_schemas_join_a_running_plain_batch_and_leave_it_each_exact(server):
    """A plain lossless stream decoding; two requests of two schemas join it mid-flight (the batch's rows get a grammar
    each, or none, and its drafts become chains) and finish first (the batch goes back to its own path): every text is
    what it is alone, plain greedy's or constrained greedy's, and they shared passes. On the eager runner
    (`--cache-slots`) too, whose pass takes up the grammars as they join and drops them once they have left
    (`Runner.use_processors`)."""
    other = {**SCHEMA, "properties": {"yes": {"type": "boolean"}}, "required": ["yes"]}
    engine, before = server["engine"], len(server["engine"].batch_sizes)
    body = _long_stream(server, 160, mars_verify=True)
    body["messages"] = [{"role": "user", "content": "a long one"}]

    async def constrained(content: str, schema: dict) -> str:
        await asyncio.sleep(0.3)
        async with AsyncOpenAI(base_url=server["url"] + "/v1", api_key="-", max_retries=0, timeout=300) as client:
            reply = await client.chat.completions.create(
                model=server["path"],
                messages=[{"role": "user", "content": content}],
                max_tokens=160,
                extra_body={"mars_verify": True},
                response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
            )
        return reply.choices[0].message.content

    async def plain() -> str:
        async with AsyncOpenAI(base_url=server["url"] + "/v1", api_key="-", max_retries=0, timeout=300) as client:
            fields = {k: v for k, v in body.items() if k not in ("stream", "mars_verify")}
            reply = await client.chat.completions.create(**fields, extra_body={"mars_verify": True})
        return reply.choices[0].message.content

    async def together():
        return await asyncio.gather(plain(), constrained("first", SCHEMA), constrained("second", other))

    long_text, first, second = asyncio.run(together())
    assert max(engine.batch_sizes[before:]) >= 2
    assert long_text == _offline_constrained(server, "a long one", 160, schema=None)
    assert first == _offline_constrained(server, "first", 160, SCHEMA)
    assert second == _offline_constrained(server, "second", 160, other)


@pytest.mark.parametrize(
    ("response_format", "reason"),
    [
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs `json_schema.schema`"),
        ({"type": "xml"}, "must have type text, json_object or json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}, "Invalid grammar"),
    ],
)
def test_a_malformed_response_format_is_a_400_naming_it(server, response_format, reason):
    body = {"model": server["path"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    response = httpx.post(server["url"] + "/v1/chat/completions", json=body | {"response_format": response_format})
    assert response.status_code == 400
    assert reason in response.json()["error"]["message"]


def test_a_json_object_response_format_writes_an_object(server):
    reply = _client(server).chat.completions.create(
        model=server["path"],
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=400,
        response_format={"type": "json_object"},
    )
    text = reply.choices[0].message.content
    assert text.startswith("{")
    assert reply.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict)


def test_n_choices_decode_as_rows_of_one_batch_each_greedys_text(server):
    """`n=3` greedy: three choices, each plain greedy's text, decoded together, usage counting all three."""
    engine, sizes = server["engine"], len(server["engine"].batch_sizes)
    reply = _client(server).chat.completions.create(
        model=server["path"], messages=[{"role": "user", "content": "three"}], max_tokens=MAX_TOKENS, n=3
    )
    expected = _offline_constrained(server, "three", MAX_TOKENS, schema=None)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [expected] * 3
    assert reply.usage.completion_tokens == 3 * MAX_TOKENS  # the random model rarely says EOS
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert max(engine.batch_sizes[sizes:]) >= 2  # rows of one batch


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_sampled_choices_with_a_seed_differ_and_come_again_with_it(server, stream):
    def ask() -> list[str]:
        reply = _client(server).completions.create(
            model=server["path"],
            prompt="seeded",
            max_tokens=12,
            n=3,
            seed=7,
            stream=stream,
            extra_body={"generation_config": '{"do_sample": true}'},
        )
        if not stream:
            return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]
        texts, usage = ["", "", ""], None
        for chunk in reply:
            for choice in chunk.choices:
                texts[choice.index] += choice.text or ""
            usage = chunk.usage or usage
        assert usage is not None and usage.completion_tokens == 3 * 12  # one usage, for the three
        return texts

    first = ask()
    assert len(set(first)) > 1  # each choice its own draws
    assert ask() == first


def test_seeded_choices_whose_siblings_never_come_decode_after_a_wait(server):
    """Two of a seeded request's three choices reach the engine (the third's client left first): after
    `GROUP_WAIT_S` they decode, and the engine serves the next request."""
    from hf_mars.serving.engine import GROUP_WAIT_S

    engine, tok, model = server["engine"], server["tok"], server["offline"]
    ids = tok("orphans", return_tensors="pt")["input_ids"]
    config = model.generation_config.__class__.from_dict(model.generation_config.to_dict())
    config.max_new_tokens, config.choices_group = 4, {"group": "orphaned", "n": 3, "seed": 1}

    async def two():
        calls = (engine.generate_non_streaming(model, tok, {"input_ids": ids}, config, f"o-{i}") for i in range(2))
        return await asyncio.gather(*calls)

    start = time.monotonic()
    answers = asyncio.run(two())
    assert time.monotonic() - start >= GROUP_WAIT_S
    assert [len(tokens) for _, _, tokens in answers] == [4, 4]
    assert _client(server).completions.create(model=server["path"], prompt="next", max_tokens=2).choices[0].text


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
            "x-guidance": {"whitespace_pattern": "[ ]{0,1}"},
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty object


def _tool_calls(server, stream: bool, max_tokens: int = 120, **fields) -> tuple[list[dict], str, str | None]:
    """A chat request for tool calls through the openai client: its calls (streamed: the deltas put together as a
    client does), its finish_reason and its content."""
    reply = _client(server).chat.completions.create(
        model=server["path"],
        messages=[{"role": "user", "content": "weather in Paris?"}],
        max_tokens=max_tokens,
        tools=[WEATHER, CLOCK],
        stream=stream,
        **fields,
    )
    if not stream:
        message = reply.choices[0]
        calls = [c.function.model_dump() | {"id": c.id} for c in message.message.tool_calls or []]
        return calls, message.finish_reason, message.message.content
    calls, finish, content = {}, None, None
    for chunk in reply:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content = (content or "") + choice.delta.content if choice.delta.content else content
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": "", "id": None})
                call["id"] = delta.id or call["id"]
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish, content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_or_required_tool_call_follows_its_tools_schema_and_lossless_keeps_constrained_greedy(server, stream):
    """`tool_choice` a named function: one call of it, whose arguments are plain constrained greedy `generate()`'s
    under its parameters' schema (lossless mode); `"required"`: a list of calls, each one of the tools with its own
    parameters (one call where `parallel_tool_calls` is false). Streamed, the deltas make the same calls."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    parameters = WEATHER["function"]["parameters"]
    for mode in MODES.values():
        calls, finish, content = _tool_calls(server, stream, tool_choice=named, extra_body=mode)
        assert finish == "tool_calls" and content is None and [c["name"] for c in calls] == ["get_weather"]
        jsonschema.validate(json.loads(calls[0]["arguments"]), parameters)
        assert calls[0]["id"].endswith("_tool_call_0")
        if mode.get("mars_verify"):
            assert calls[0]["arguments"] == _offline_constrained(server, "weather in Paris?", 120, parameters)
    one = {"parallel_tool_calls": False, "extra_body": {"mars_verify": True}}  # JSON_OPTIONS' whitespace: 32 a gap
    calls, finish, _ = _tool_calls(server, stream, max_tokens=500, tool_choice="required", **one)
    assert finish == "tool_calls" and len(calls) == 1 and calls[0]["name"] in ("get_weather", "get_time")
    arguments = json.loads(calls[0]["arguments"])
    if calls[0]["name"] == "get_weather":
        jsonschema.validate(arguments, parameters)
    else:
        assert arguments == {}


def test_tool_requests_the_server_cannot_honour_are_a_400_naming_why(server):
    """`"auto"` where the chat template renders no tools (the model would never see them), a function that is not
    one of the tools, a choice without tools, and malformed tools: refused by name."""
    url, base = server["url"] + "/v1/chat/completions", {"model": server["path"], "max_tokens": 4}
    base["messages"] = [{"role": "user", "content": "hi"}]
    cases = [
        ({"tools": [WEATHER]}, "tool_choice='auto' (the default with tools) needs a chat template that renders tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "which is not one of"),
        ({"tool_choice": "required"}, "tool_choice='required' needs tools"),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, "each tool must be"),
        ({"tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": False}, "parallel_tool_calls=false"),
    ]
    for fields, reason in cases:
        response = httpx.post(url, json=base | fields, timeout=60)
        assert response.status_code == 400, fields
        assert reason in response.json()["error"]["message"]
    unused = httpx.post(url, json=base | {"tools": [WEATHER], "tool_choice": "none"}, timeout=60).json()
    assert unused["choices"][0]["message"]["content"] and "tool_calls" not in unused["choices"][0]["message"]


def _plain_logprobs(server, content: str, max_tokens: int, chat: bool = True) -> tuple[list[int], torch.Tensor]:
    """Plain greedy `generate()`'s tokens for this prompt alone (as the endpoint tokenizes it) and the log-softmax of
    the scores it chose each from: the model's own, float32."""
    tok, model = server["tok"], server["offline"]
    if chat:
        messages = [{"role": "user", "content": content}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    else:
        ids = tok(content, return_tensors="pt")
    out = model.generate(
        **ids, do_sample=False, max_new_tokens=max_tokens, output_scores=True, return_dict_in_generate=True
    )
    tokens = out.sequences[0, ids["input_ids"].shape[1] :].tolist()
    return tokens, torch.stack(out.scores, dim=1)[0].float().log_softmax(dim=-1)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_decoded_tokens_log_probabilities_are_the_models_own(server, stream):
    """`logprobs` with `top_logprobs=5` (chat) and `logprobs=3` (completions) through the openai client: lossless
    mode's and τ = 1's are plain greedy decoding's, each token's log-softmax and its top alternatives (float32, 1e-4),
    streamed (the chunks' put together) or whole; τ = 0.9's each slot's own, its chosen token the likeliest."""
    client, prompt = _client(server), "count to five"
    fields = dict(model=server["path"], max_tokens=MAX_TOKENS, stream=stream)

    def chat(mode: dict) -> list:
        reply = client.chat.completions.create(
            **fields, messages=[{"role": "user", "content": prompt}], logprobs=True, top_logprobs=5, extra_body=mode
        )
        choices = [reply.choices[0]] if not stream else [c.choices[0] for c in reply if c.choices]
        return [entry for choice in choices if choice.logprobs for entry in choice.logprobs.content]

    tokens, expected = _plain_logprobs(server, prompt, MAX_TOKENS)
    tok, at = server["tok"], torch.arange(len(tokens))
    for mode in ({"mars_verify": True}, {"mars_tau": 1.0}):
        entries = chat(mode)
        assert [e.token for e in entries] == [tok.decode([t]) for t in tokens]
        assert [e.logprob for e in entries] == pytest.approx(expected[at, torch.tensor(tokens)].tolist(), abs=1e-4)
        top = expected.topk(5, dim=-1).values
        assert torch.allclose(torch.tensor([[t.logprob for t in e.top_logprobs] for e in entries]), top, atol=1e-4)
    for entry in chat({"mars_tau": 0.9}):
        assert entry.logprob <= 0 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6)

    reply = client.completions.create(**fields, prompt=prompt, logprobs=3, extra_body={"mars_verify": True})
    choices = [reply.choices[0]] if not stream else [c.choices[0] for c in reply if c.choices]
    scored = [lp for c in choices if c.logprobs for lp in c.logprobs.token_logprobs]
    offsets = [o for c in choices if c.logprobs for o in c.logprobs.text_offset]
    tokens, expected = _plain_logprobs(server, prompt, MAX_TOKENS, chat=False)
    at = torch.arange(len(tokens))
    assert scored == pytest.approx(expected[at, torch.tensor(tokens)].tolist(), abs=1e-4)
    assert offsets == [sum(len(tok.decode([t])) for t in tokens[:i]) for i in range(len(tokens))]


def test_rows_asking_for_log_probabilities_batch_with_rows_that_do_not_each_getting_its_own(server):
    """Six clients at once, lossless: two ask for no log probabilities, two for 2 alternatives, two for 5; they decode
    batched (on the eager runner's engine too, whose pass records them: `Runner.logprobs`), each text greedy's alone,
    each asking row its own tokens' log probabilities with as many alternatives as it asked for."""
    tops = [None, None, 2, 2, 5, 5]

    async def ask(i: int, top: int | None):
        await asyncio.sleep(0.01 * i)
        scored = {} if top is None else {"logprobs": True, "top_logprobs": top}
        async with AsyncOpenAI(base_url=server["url"] + "/v1", api_key="-", max_retries=0, timeout=300) as client:
            return await client.chat.completions.create(
                model=server["path"],
                messages=[{"role": "user", "content": f"row {i}"}],
                max_tokens=MAX_TOKENS,
                extra_body={"mars_verify": True},
                **scored,
            )

    engine, before = server["engine"], len(server["engine"].batch_sizes)
    replies = _batched(server, [ask(i, top) for i, top in enumerate(tops)])
    assert max(engine.batch_sizes[before:]) > 2  # more rows than any one ask has: asks mixed in one batch
    assert engine._graph.logprobs == 5  # the runner's pass recorded them, as many alternatives as any row asked for
    for i, (top, reply) in enumerate(zip(tops, replies)):
        tokens, expected = _plain_logprobs(server, f"row {i}", MAX_TOKENS)
        assert reply.choices[0].message.content == server["tok"].decode(tokens, skip_special_tokens=True)
        if top is None:
            assert reply.choices[0].logprobs is None
            continue
        entries = reply.choices[0].logprobs.content
        at = torch.arange(len(tokens))
        assert [e.logprob for e in entries] == pytest.approx(expected[at, torch.tensor(tokens)].tolist(), abs=1e-4)
        assert all(len(e.top_logprobs) == top for e in entries)


def test_best_of_answers_the_likeliest_choices_per_token_of_those_decoded(server):
    """`best_of=4, n=2` sampled with a seed: the two of the four choices (the same seed's `n=4`, with their log
    probabilities) of the highest log probability per token, likeliest first, usage counting all four; no
    `logprobs` shown where not asked. Streamed, or below n: a 400 naming why."""
    url = server["url"] + "/v1/completions"
    base = {"model": server["path"], "prompt": "pick", "max_tokens": 8, "seed": 7}
    base["generation_config"] = '{"do_sample": true}'
    every = httpx.post(url, json=base | {"n": 4, "logprobs": 0}, timeout=120).json()["choices"]

    def per_token(choice) -> float:
        scored = choice["logprobs"]["token_logprobs"]
        return sum(scored) / len(scored)

    assert len({c["text"] for c in every}) > 1  # the premise: sampling drew different choices
    expected = [c["text"] for c in sorted(every, key=per_token, reverse=True)[:2]]
    best = httpx.post(url, json=base | {"n": 2, "best_of": 4}, timeout=120).json()
    assert [c["text"] for c in best["choices"]] == expected and [c["index"] for c in best["choices"]] == [0, 1]
    assert all("logprobs" not in c or c["logprobs"] is None for c in best["choices"])
    assert best["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in every)
    for fields, reason in (
        ({"best_of": 1, "n": 2}, "best_of must be an integer in [n, 128]"),
        ({"best_of": 3, "stream": True}, "cannot be streamed"),
    ):
        response = httpx.post(url, json=base | fields, timeout=60)
        assert response.status_code == 400 and reason in response.json()["error"]["message"]


@pytest.mark.parametrize("n", [0, 129, "3", 1.5])
def test_an_n_out_of_range_is_a_400(server, n):
    body = {"model": server["path"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": n}
    response = httpx.post(server["url"] + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert "n must be an integer in [1, 128]" in response.json()["error"]["message"]


def test_a_prompts_log_probabilities_are_the_models_own(server):
    """`echo` with `logprobs` on /v1/completions (lm-eval's loglikelihood requests): one forward's log probabilities
    for every prompt token after the first, the top k at each, and the greedy next token; text or token ids, a batch
    of prompts one choice each. Decoding's log probabilities stay refused by name."""
    tok, model, url = server["tok"], server["offline"], server["url"] + "/v1/completions"
    ids = tok("count 1 to 5")["input_ids"]
    base = {"model": server["path"], "echo": True, "logprobs": 2, "temperature": 0}
    reply = httpx.post(url, json={**base, "prompt": [ids, "count 1 to 5"], "max_tokens": 1}, timeout=60).json()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    following = int(expected[-1].argmax())
    for choice in reply["choices"]:
        scored = choice["logprobs"]
        assert scored["token_logprobs"][0] is None and len(scored["token_logprobs"]) == len(ids) + 1
        wanted = expected[torch.arange(len(ids)), torch.tensor(ids[1:] + [following])]
        assert scored["token_logprobs"][1:] == pytest.approx(wanted.tolist(), abs=1e-4)
        tops = scored["top_logprobs"][1:]  # two tokens of one text (a byte-level piece) count once, the likelier
        assert all(1 <= len(top) <= 2 and max(top.values()) >= lp - 1e-4 for top, lp in zip(tops, wanted.tolist()))
        assert choice["text"] == tok.decode(ids + [following])
    assert [c["index"] for c in reply["choices"]] == [0, 1] and reply["usage"]["completion_tokens"] == 2
    none_new = httpx.post(url, json={**base, "prompt": ids, "max_tokens": 0}, timeout=60).json()["choices"][0]
    assert none_new["text"] == tok.decode(ids) and len(none_new["logprobs"]["tokens"]) == len(ids)
    decoding = httpx.post(url, json={**base, "prompt": ids, "max_tokens": 4}, timeout=60)
    assert decoding.status_code == 400 and "echo=True is not supported" in decoding.json()["error"]["message"]


def test_completions_take_their_prompt_as_token_ids(server):
    tok, url = server["tok"], server["url"] + "/v1/completions"
    ask = {"model": server["path"], "max_tokens": 8, "temperature": 0}
    as_text = httpx.post(url, json={**ask, "prompt": "count 2 to 9"}, timeout=60).json()
    as_ids = httpx.post(url, json={**ask, "prompt": tok("count 2 to 9")["input_ids"]}, timeout=60).json()
    assert as_ids["choices"][0]["text"] == as_text["choices"][0]["text"]
    assert as_ids["usage"]["prompt_tokens"] == as_text["usage"]["prompt_tokens"]
    two = httpx.post(url, json={**ask, "prompt": [[1, 2], [3, 4]]}, timeout=60)
    assert two.status_code == 400 and "one prompt per request" in two.json()["error"]["message"]


def test_malformed_json_and_unknown_fields_are_refused(server):
    url = server["url"] + "/v1/chat/completions"
    broken = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}, timeout=60)
    assert broken.status_code == 422
    body = {"model": server["path"], "messages": [{"role": "user", "content": "hi"}], "mars_taus": 0.9}
    assert httpx.post(url, json=body, timeout=60).status_code == 422
    with pytest.raises(BadRequestError, match="mars_tau"):
        _client(server).chat.completions.create(
            model=server["path"], messages=[{"role": "user", "content": "hi"}], extra_body={"mars_tau": -0.5}
        )


def test_a_short_request_sent_while_a_long_one_decodes_is_answered_before_it_ends(server):
    engine = server["engine"]
    body = _long_stream(server, 500, mars_tau=1.0)
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", server["url"] + "/v1/chat/completions", json=body) as response:
            long_id = response.headers["x-request-id"]
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # the long row decodes
            reply = _client(server).chat.completions.create(  # the same settings: it joins the long one's batch
                model=server["path"],
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                extra_body={"mars_tau": 1.0},
            )
            long_done = any(row["request_id"] == long_id for row in engine.finished)
            rest = list(lines)
    assert reply.usage.completion_tokens == 4
    assert not long_done, ("the short request waited for the long one", list(engine.finished)[-3:])
    assert sum(line.startswith("data:") for line in rest) > 4, "the long stream did not go on after the short reply"


@pytest.mark.parametrize("mode", ["tau=1", "lossless"])
def test_a_longer_prompt_joining_a_running_row_leaves_both_texts_exact(server, mode):
    """A request whose prompt is longer than the running row's joins it between passes (the running row's cache is
    padded with holes on its left, which its passes must not see): both get their prompt alone's text. (A stream's
    end sends the bytes of a character its budget cut, as one replacement character; `_offline` drops them.)"""
    import json

    body = _long_stream(server, 200, **MODES[mode])
    longer = "count from one to twenty, slowly, in words, then back"
    before = len(server["engine"].batch_sizes)
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", server["url"] + "/v1/chat/completions", json=body) as response:
            lines = (line[5:] for line in response.iter_lines() if line.startswith("data:") and "[DONE]" not in line)
            chunks = [next(lines)]  # the first row decodes: the next request joins it
            reply = _client(server).chat.completions.create(
                model=server["path"],
                messages=[{"role": "user", "content": longer}],
                max_tokens=MAX_TOKENS,
                extra_body=MODES[mode],
            )
            chunks += list(lines)
    assert max(server["engine"].batch_sizes[before:]) > 1, "the longer request must have joined the running row"
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in map(json.loads, chunks) if c["choices"])
    cut = "\ufffd"  # a character whose bytes the budget cut
    alone = _offline(server, body["messages"][0]["content"], MODES[mode], 200)[0]
    assert streamed.rstrip(cut) == alone.rstrip(cut)
    assert reply.choices[0].message.content.rstrip(cut) == _offline(server, longer, MODES[mode])[0].rstrip(cut)


def test_continuous_batching_flag_is_accepted():
    from hf_mars.cli import build_parser

    args = build_parser().parse_args(["serve", "--continuous-batching", "some/model"])
    assert args.continuous_batching and args.model == "some/model"


def test_cache_slots_are_checked_and_belong_to_the_hf_mars_engine():
    from hf_mars.cli import build_parser

    for argv, message in (
        (["serve", "--cache-slots", "-1", "some/model"], "--cache-slots must be at least 1"),
        (["serve", "--cache-slots", "0", "--compile", "some/model"], "--cache-slots must be at least 1"),
        (["serve", "--engine", "vllm", "--cache-slots", "512", "some/model"], "--cache-slots is an hf_mars engine"),
    ):
        args = build_parser().parse_args(argv)
        with pytest.raises(ValueError, match=message):
            args.run(args)


def test_serve_bench_measures_plain_and_mars_side_by_side(server):
    """Plain and lossless rows per client count, and the share of each row's answers equal to its prompt's plain
    answer alone (float32 here: all of them)."""
    from hf_mars.tools.measure.serve_bench import run_serve_bench, serve_table

    rows = run_serve_bench(server["url"] + "/v1", server["path"], clients=(1, 3), per_client=1, max_tokens=6, rounds=1)
    assert [(r["clients"], r["mode"]) for r in rows] == [
        (1, "plain"),
        (1, "MARS lossless"),
        (3, "plain"),
        (3, "MARS lossless"),
    ]
    assert all(r["requests"] == r["clients"] and r["tokens_per_s"] > 0 and r["ttft_p50_ms"] > 0 for r in rows)
    assert all(r["same_as_alone"] == 1.0 for r in rows)
    table = serve_table(rows)
    assert table.count("\n") == 5 and "1.00x" in table  # a plain row against itself
    assert "= alone" in table and table.count("| 100% |") == 4


def test_serve_bench_ramps_the_tau_policy_against_tau_1_and_plain(server, tmp_path):
    """`hf-mars bench --serve --tau-range`: three modes per client count, the τ the policy chose (one client: its
    highest), and the share of answers equal to τ = 1's (plain's are: greedy), and the plot."""
    from hf_mars.tools.measure.serve_bench import ramp_modes, run_serve_bench, serve_plot, serve_table

    modes = ramp_modes(0.5)
    rows = run_serve_bench(
        server["url"] + "/v1", server["path"], clients=(1, 3), per_client=1, max_tokens=6, rounds=1, modes=modes
    )
    assert [(r["clients"], r["mode"]) for r in rows] == [(c, m) for c in (1, 3) for m in modes]
    ranged = [r for r in rows if r["mode"] == "MARS τ in [0.5, 1]"]
    assert ranged[0]["tau_mean"] == 1.0 and all(0.5 <= r["tau_min"] <= r["tau_mean"] <= 1.0 for r in ranged)
    assert all(r["tau_mean"] is None for r in rows if r not in ranged)
    assert all(r["same_as_tau_1"] == 1.0 for r in rows if r["mode"] in ("plain", "MARS τ = 1"))
    table = serve_table(rows)
    assert "vs τ = 1" in table and table.count("\n") == 7
    serve_plot(rows, tmp_path / "ramp.png")
    assert (tmp_path / "ramp.png").stat().st_size > 10_000


def test_with_an_api_key_only_its_bearers_are_served_and_health_stays_open(tmp_path, caplog):
    """`hf-mars serve --api-key` (or HF_MARS_API_KEY): as `vllm serve --api-key`, every endpoint but /health answers
    401 in OpenAI's error shape without the bearer token; the key appears in no log."""
    import logging

    from openai import AuthenticationError

    from hf_mars.serving.server import build_app

    tok, model = make_tokenizer(), make_model("llama")
    to_mars(model, tok, block_size=4)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    key = "sk-test-4b1d2c"
    caplog.set_level(logging.DEBUG)
    app, _ = build_app(str(tmp_path), dtype="float32", device="cpu", max_batch_size=2, api_key=key)
    with serving(app) as url:
        assert httpx.get(url + "/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/metrics")):
                refused = httpx.request(method, url + path, headers=headers, json={}, timeout=60)
                assert refused.status_code == 401, (path, headers)
                assert refused.json()["error"]["code"] == "invalid_api_key"
        client = OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model=str(tmp_path), messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert reply.usage.completion_tokens == 3
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    assert key not in caplog.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_ends_the_text_before_it_as_openais_api_does(server, stream):
    """The stop sequence is taken from the text greedy decoding writes for this prompt, past its start: the answer is
    that text up to the sequence, without it, streamed or not (text that might begin it is held back, then sent)."""
    content = "count 3 to 12"
    full, _ = _offline(server, content, {})
    fresh = (i for i in range(3, len(full) - 2) if full[i : i + 2].isprintable() and full.find(full[i : i + 2]) == i)
    start = next(fresh)
    stop = full[start : start + 2]
    reply = _client(server).chat.completions.create(
        model=server["path"],
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stop=[stop, "never-written-\u2603"],
        stream=stream,
    )
    if stream:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)
    else:
        text = reply.choices[0].message.content
    assert text == full[:start] and stop not in text


def test_a_tau_range_alone_on_the_server_runs_at_its_highest_tau_and_keeps_greedys_text(server):
    """Nothing waits and one row decodes: the policy gives up no quality, so [0.3, 1] runs at τ = 1, exactly."""
    text, usage = asyncio.run(_ask(server["url"], server["path"], "count 5 to 14", mars_tau=[0.3, 1.0]))
    assert (text, usage.completion_tokens) == _offline(server, "count 5 to 14", {"mars_tau": 1.0})
    assert usage.mars_tau == {"mean": 1.0, "min": 1.0, "max": 1.0}


def test_under_load_ranged_rows_stay_in_their_range_and_single_tau_rows_are_never_changed(server, monkeypatch):
    """Twelve rows allowing [0.5, 1] arrive with four at τ = 1: the ranged rows' τ moves with the load and never
    leaves their range (it falls below 1 under this load, the policy deciding by the load alone: the pass costs that
    the server times in the background, on a machine the other tests keep busy, could say either way); the τ = 1 rows
    keep greedy `generate()`'s text and report no τ range."""
    from hf_mars.serving import engine as engine_module

    def unmeasured(*args, **kwargs):
        raise engine_module.NotMeasured("not in this test")

    monkeypatch.setattr(engine_module, "pass_costs", unmeasured)
    monkeypatch.setattr(server["engine"], "_policies", {})  # built again here, reading no costs (restored after)
    url, model = server["url"], server["path"]
    fields = [{"mars_tau": 1.0} if i % 4 == 3 else {"mars_tau": [0.5, 1.0]} for i in range(16)]
    jobs = [(f"count {i} to {i + 9}", mode) for i, mode in enumerate(fields)]

    async def all_of_them():
        return await asyncio.gather(*[_ask(url, model, c, 0.01 * i, **f) for i, (c, f) in enumerate(jobs)])

    results = asyncio.run(all_of_them())
    ranged = [usage.mars_tau for (_, fields), (_, usage) in zip(jobs, results) if fields["mars_tau"] != 1.0]
    assert all(0.5 <= tau["min"] <= tau["mean"] <= tau["max"] <= 1.0 for tau in ranged), ranged
    assert min(tau["min"] for tau in ranged) < 1.0, "twelve rows of sixteen are load: τ must fall"
    for (content, fields), (text, usage) in zip(jobs, results):
        if fields["mars_tau"] == 1.0:
            assert (text, usage.completion_tokens) == _offline(server, content, fields), content
            assert getattr(usage, "mars_tau", None) is None
    assert 0.0 <= _scrape(server)[("hf_mars_load_pressure", ())] <= 1.0


def test_the_servers_tau_range_is_for_requests_that_set_no_mars_field(tmp_path):
    """`hf-mars serve --tau-range LO HI`: a request without MARS fields decodes in τ-mode within the range; one that
    sets its own τ, or lossless mode, keeps it."""
    from hf_mars.serving.server import build_app

    tok, model = make_tokenizer(), make_model("llama")
    to_mars(model, tok, block_size=4)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    app, engine = build_app(str(tmp_path), dtype="float32", device="cpu", max_batch_size=4, tau_range=(0.6, 0.8))
    with serving(app) as url:
        _, default = asyncio.run(_ask(url, str(tmp_path), "hi"))
        _, own = asyncio.run(_ask(url, str(tmp_path), "hi", mars_tau=0.9))
        _, lossless = asyncio.run(_ask(url, str(tmp_path), "hi", mars_verify=True))
    assert default.mars_tau == {"mean": 0.8, "min": 0.8, "max": 0.8}  # alone: the range's highest τ
    assert getattr(own, "mars_tau", None) is None and getattr(lossless, "mars_tau", None) is None
    with pytest.raises(ValueError, match="or a range"):
        build_app(str(tmp_path), dtype="float32", device="cpu", tau_range=(0.9, 0.1))


def test_lossless_rows_get_the_tree_of_the_rows_running_now_and_keep_greedys_text(tmp_path):
    """A lossless preset by batch size (as `hf-mars tune` saves one, and as `"auto"` chooses from the pass costs):
    one row decodes with its 4-token tree, four rows with the 2-token chain: the long row's tree changes as three
    others join it and again when they leave; every text is greedy `generate()`'s. In the default eager runner, built
    for both trees (`MARSEngine._trees`). (A compiled pass has its tree's shape and keeps it:
    test_runner.py.)"""
    from hf_mars.serving.server import build_app

    tok, model = make_tokenizer(), make_model("llama")
    to_mars(model, tok, block_size=4)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    path = str(tmp_path)
    app, engine = build_app(path, dtype="float32", device="cpu", max_batch_size=4)
    offline = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
    preset = {"1": {"mars_block_size": 4, "mars_draft_candidates": 2}, "4": {"mars_block_size": 2}}
    mode = {"mars_verify": True, "mars_lossless": preset}
    prompts = ["count 1 to 40"] + [f"count {i} to {i + 9}" for i in range(3)]

    async def joining(url):
        long = asyncio.create_task(_ask(url, path, prompts[0], 0.0, 480, **mode))
        while not engine.batch_sizes:  # the long row is past its prompt's pass
            await asyncio.sleep(0.005)
        short = await asyncio.gather(*[_ask(url, path, prompt, **mode) for prompt in prompts[1:]])
        return [await long, *short]

    with serving(app) as url:
        results = asyncio.run(joining(url))
    assert max(engine.batch_sizes) == 4, "premise: the three short rows joined the long one"
    served = {"tok": tok, "offline": offline}
    for prompt, budget, (text, usage) in zip(prompts, [480] + [MAX_TOKENS] * 3, results):
        assert (text, usage.completion_tokens) == _offline(served, prompt, {}, budget), prompt
    changes = [tree for _, tree in engine.tree_changes]
    assert "2x1" in changes and "4x2" in changes[changes.index("2x1") :], engine.tree_changes
    assert engine._graph.widened, "the runner's pass was built for both trees"


def test_a_preset_tree_is_rechosen_at_its_own_batch_size_whatever_order_rows_join_in(tmp_path):
    """Rows that join one, then two at a time (1 -> 3 -> 4 rows) get the preset's 4-row tree at 4: 3 and 4 share a
    power of two, and re-choosing only when that changed kept the 1-row tree (a race the served test above met when
    its three requests arrived apart)."""
    from types import SimpleNamespace

    from hf_mars.serving.server import build_app

    tok, model = make_tokenizer(), make_model("llama")
    to_mars(model, tok, block_size=4)
    model.generation_config.mars_lossless = {
        "1": {"mars_block_size": 4, "mars_draft_candidates": 2},
        "4": {"mars_block_size": 2},
    }
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    _, engine = build_app(str(tmp_path), dtype="float32", device="cpu", max_batch_size=4)
    config = engine.model.generation_config.__class__.from_dict(engine.model.generation_config.to_dict())
    config.mars_verify, config.max_new_tokens = True, 8  # as a request's config carries them
    request = SimpleNamespace(tau_range=None, generation_config=config, apart=False)
    ids = tok(["count 1 to 40"], return_tensors="pt").input_ids
    with torch.inference_mode():  # the engine's runner, built for both trees, its settings chosen for 4 rows
        rows = engine.model.mars_rows(ids, generation_config=config, labels=[request], max_rows=4)
        runner = engine._graph_for(rows)
        runner.admit(rows)
        for count in (1, 3, 4, 3, 1):
            engine._choose_tree(runner, count)
    assert list(engine.tree_changes) == [(1, "4x2"), (4, "2x1"), (3, "4x2")]


def _scrape(server) -> dict:
    """`/metrics` parsed as Prometheus text: `{(name, labels): value}`."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(server["url"] + "/metrics", timeout=60)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    families = text_string_to_metric_families(response.text)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in families for s in family.samples}


def test_metrics_parse_as_prometheus_text_and_count_what_was_sent(server):
    """Three requests at τ = 1 (one token a pass): the finished requests, tokens, row passes, tokens accepted at
    position 0 and none past it, and one first-token latency each, as deltas of two scrapes."""
    before = _scrape(server)
    client = _client(server)
    replies = [
        client.chat.completions.create(
            model=server["path"], messages=[{"role": "user", "content": f"say {i}"}], max_tokens=5 + i,
            extra_body={"mars_tau": 1.0},
        )
        for i in range(3)
    ]  # fmt: skip
    after = _scrape(server)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    tokens = sum(r.usage.completion_tokens for r in replies)
    assert delta("hf_mars_requests_total", outcome="stop") == 3
    assert delta("hf_mars_generation_tokens_total") == tokens
    assert delta("hf_mars_accepted_tokens_total", position="0") == tokens  # τ = 1: one token a pass
    assert delta("hf_mars_accepted_tokens_total", position="1") == 0
    assert delta("hf_mars_row_passes_total") == sum(r.usage.forward_passes for r in replies) == tokens
    assert delta("hf_mars_time_to_first_token_seconds_count") == 3
    assert delta("hf_mars_inter_token_latency_seconds_count") == tokens - 3
    assert delta("hf_mars_e2e_request_latency_seconds_count") == 3
    deadline = time.monotonic() + 30
    while _scrape(server)[("hf_mars_requests_running", ())] != 0:  # the engine reports after the pass it answered in
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert _scrape(server)[("hf_mars_requests_waiting", ())] == 0


def test_speculation_is_counted_under_vllms_names(server):
    """τ = 0.9 (B = 4, three masks a pass) then τ = 1: under vLLM's `spec_decode` names, each of the first's passes
    after its prompt's is a draft of 3 tokens, its accepted tokens are its tokens past the first of each pass (so
    tokens = passes + accepted), position p counts no more than position p - 1; τ = 1 drafts nothing."""
    name = Path(server["path"]).name
    labels = {"model_name": name, "engine": "0"}
    client, before = _client(server), _scrape(server)

    def ask(mode: dict):
        messages = [{"role": "user", "content": "count on"}]
        return client.chat.completions.create(model=server["path"], messages=messages, max_tokens=40, extra_body=mode)

    def delta(scrape, metric, **more):
        key = (metric, tuple(sorted({**labels, **more}.items())))
        return scrape.get(key, 0.0) - before.get(key, 0.0)

    reply, after = ask({"mars_tau": 0.9}), _scrape(server)
    drafts = delta(after, "vllm:spec_decode_num_drafts_total")
    accepted = delta(after, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts == reply.usage.forward_passes - 1  # every pass but the prompt's
    assert delta(after, "vllm:spec_decode_num_draft_tokens_total") == 3 * drafts
    assert reply.usage.completion_tokens == reply.usage.forward_passes + accepted
    by_position = [delta(after, "vllm:spec_decode_num_accepted_tokens_per_pos", position=str(p)) for p in range(3)]
    assert sum(by_position) == accepted and by_position == sorted(by_position, reverse=True)
    ask({"mars_tau": 1.0})
    assert delta(_scrape(server), "vllm:spec_decode_num_drafts_total") == drafts


def test_metrics_show_the_tau_and_tree_of_the_rows_decoding(server):
    body = _long_stream(server, 480, mars_tau=0.9)
    cancelled = _scrape(server).get(("hf_mars_requests_total", (("outcome", "cancelled"),)), 0.0)
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", server["url"] + "/v1/chat/completions", json=body) as response:
            data = (line for line in response.iter_lines() if line.startswith("data:"))
            for _ in range(3):  # past the prompt's pass: the engine reports after each pass
                next(data)
            during = _scrape(server)
    assert during[("hf_mars_tau", ())] == 0.9 and during[("hf_mars_requests_running", ())] == 1
    trees = [labels for (name, labels), value in during.items() if name == "hf_mars_tree_info" and value == 1]
    assert len(trees) == 1 and dict(trees[0])["mode"] == "tau" and dict(trees[0])["block_size"] == "4"
    deadline = time.monotonic() + 60
    while _scrape(server).get(("hf_mars_requests_total", (("outcome", "cancelled"),)), 0.0) != cancelled + 1:
        assert time.monotonic() < deadline, "the client that left must count as cancelled"
        time.sleep(0.05)
    assert math.isnan(_scrape(server)[("hf_mars_tau", ())])  # nothing decoding


def test_with_ordered_attention_in_bfloat16_every_row_under_load_gets_its_batch_1_text(tmp_path):
    """`hf-mars serve --attention ordered --dtype bfloat16`: twelve streams at once, plain, τ = 1 and lossless, rows
    joining and leaving the running batch, each get the text plain greedy `generate()` gives their prompt alone, in
    bfloat16 (a flat random model, whose close scores let rounding flip choices: with `sdpa` on the AVX2 CPU of
    docs/benchmarks.md a row's text parts from its own). This rests on the CPU's products giving a row the same bits
    in `ordered`'s linear layers, which the run checks first."""
    attention = "ordered"
    from hf_mars.serving.server import build_app

    if not rows_invariant_linear(torch.bfloat16):
        pytest.skip("this CPU's bfloat16 matrix kernels round a row by the rows beside it, padded or not")
    tok, model = make_tokenizer(), make_model("llama", initializer_range=0.05)
    to_mars(model, tok, block_size=4)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    path = str(tmp_path)
    app, engine = build_app(path, dtype="bfloat16", device="cpu", max_batch_size=12, attention=attention)
    assert engine.model.config._attn_implementation == attention
    offline = AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=True, dtype=torch.bfloat16, attn_implementation=attention
    ).eval()
    modes = [{}, MODES["tau=1"], MODES["lossless"]]
    jobs = [(f"count {i} to {i + 9}", modes[i % 3]) for i in range(12)]
    server = {"url": None, "engine": engine, "tok": tok, "offline": offline}
    with serving(app) as url:
        server["url"] = url
        results = _batched(server, [_ask(url, path, c, 0.01 * i, 64, **mode) for i, (c, mode) in enumerate(jobs)])
    for (content, mode), (text, usage) in zip(jobs, results):
        assert (text, usage.completion_tokens) == _offline(server, content, {}, 64), (content, mode)


def test_requests_waiting_take_every_free_row_even_where_the_free_rows_are_apart(tmp_path):
    """Rows that join together take adjacent free rows (their prompt's pass writes a view of them). When the rows that
    stopped are apart (rows 0 and 2 of 4 free, 1 and 3 decoding), two waiting requests still both join before the
    next pass, one into each run of free rows, and every request gets greedy `generate()`'s tokens alone. (The
    engine's thread is stopped: its verbs are driven here, between passes.)"""
    from transformers import GenerationConfig

    from hf_mars.serving.engine import MARSEngine, Request, RowSink

    tok, model = make_tokenizer(), make_model("llama")
    to_mars(model, tok, block_size=4)
    engine = MARSEngine(model.eval(), tok, max_batch_size=4, cache_slots=256)
    engine.stop()
    engine._thread.join()
    config = GenerationConfig.from_dict({**model.generation_config.to_dict(), "mars_verify": True})
    config.eos_token_id = None  # every row decodes its whole budget

    def request(i, budget):
        ids = tok(f"count {i} to {i + 9}").input_ids
        return Request(f"r{i}", ids, config, budget, RowSink(None))

    first = [request(i, budget) for i, budget in enumerate((2, 30, 2, 30))]
    engine._waiting = list(first)
    with torch.inference_mode():
        engine._admit()
        engine.runner.condenses = False  # as a compiled runner's rows stay where they are (`Runner._condense`)
        while any(r in engine.runner.labels for r in (first[0], first[2])):
            engine._step()
        assert engine.runner.row_labels[1:4:2] == [first[1], first[3]], "premise: the free rows are 0 and 2"
        assert engine.runner.room == 1
        later = [request(i, 12) for i in (4, 5)]
        engine._waiting = list(later)
        engine._admit()
        assert not engine._waiting and sorted(map(id, engine.runner.labels)) == sorted(map(id, first[1::2] + later))
        while engine.runner is not None:
            engine._step()
    for r in first + later:
        alone = model.generate(
            torch.tensor([r.input_ids]), do_sample=False, max_new_tokens=r.max_new_tokens, eos_token_id=None
        )
        assert r.generated == alone[0, len(r.input_ids) :].tolist(), r.request_id


def test_the_runners_cache_is_allocated_once_as_the_engine_starts_and_kept_across_settings(tmp_path, monkeypatch):
    """An engine that decodes in an eager runner (`cache_slots`, no `--compile`) allocates its runner's static cache
    (rows x `cache_slots`) as its thread starts, before any request waits on it, and the runners that later settings
    build decode on that same cache: no allocation per request or per change of settings, and every request still
    gets greedy `generate()`'s tokens alone. (The engine's thread is stopped once it has started: its verbs are
    driven here.)"""
    from transformers import GenerationConfig

    from hf_mars.decoding import runner
    from hf_mars.serving import engine as engine_module
    from hf_mars.serving.engine import MARSEngine, Request, RowSink

    allocated, allocate = [], runner.rows_cache
    for module in (runner, engine_module):
        monkeypatch.setattr(module, "rows_cache", lambda *a: allocated.append(a[1:]) or allocate(*a))
    tok, model = make_tokenizer(), make_model("llama")
    to_mars(model, tok, block_size=4)
    engine = MARSEngine(model.eval(), tok, max_batch_size=2, cache_slots=256)
    engine.stop()
    engine._thread.join()
    assert allocated == [(2, 256)] and engine.runner is None, "allocated as it started, before any request"
    served = []
    for i, settings in enumerate(({"mars_verify": True}, {"mars_tau": 1.0}, {"mars_tau": 0.9})):
        config = GenerationConfig.from_dict({**model.generation_config.to_dict(), **settings})
        request = Request(f"r{i}", tok(f"count {i} to {i + 9}").input_ids, config, 12, RowSink(None))
        engine._waiting = [request]
        with torch.inference_mode():
            engine._admit()
            served.append(engine.runner)
            while engine.runner is not None:
                engine._step()
        alone = model.generate(torch.tensor([request.input_ids]), do_sample=False, max_new_tokens=12, **settings)
        assert request.generated == alone[0, len(request.input_ids) :].tolist(), settings
    assert len({id(r) for r in served}) > 1, "premise: a runner built for later settings"
    assert allocated == [(2, 256)] and all(r.graph.kv is served[0].graph.kv for r in served)


def test_an_engine_whose_cache_could_not_be_allocated_at_start_serves_on(monkeypatch):
    """Allocating the runner's cache as the engine starts can fail (memory): the engine's thread must not die with
    it. It logs, and the first runner allocates its own: the request is served, its text `generate()`'s alone."""
    from transformers import GenerationConfig

    from hf_mars.serving import engine as engine_module
    from hf_mars.serving.engine import MARSEngine, Request, RowSink

    class Answered(RowSink):
        def __init__(self):
            super().__init__(None)
            self.done, self.error = threading.Event(), None

        def finish(self, request, error=None):
            self.error = error
            self.done.set()

    def fails(*args):
        raise RuntimeError("out of memory (as a test says)")

    monkeypatch.setattr(engine_module, "rows_cache", fails)
    tok, model = make_tokenizer(), make_model("llama")
    to_mars(model, tok, block_size=4)
    engine = MARSEngine(model.eval(), tok, max_batch_size=2, cache_slots=256)
    config = GenerationConfig.from_dict(model.generation_config.to_dict())
    config.eos_token_id = None  # the whole budget
    sink = Answered()
    request = Request("r", tok("count 1 to 9").input_ids, config, 8, sink)
    engine._queue.put(request)
    assert sink.done.wait(120) and sink.error is None, sink.error
    assert engine._thread.is_alive(), "the engine serves on"
    engine.stop()
    alone = model.generate(torch.tensor([request.input_ids]), do_sample=False, max_new_tokens=8, eos_token_id=None)
    assert request.generated == alone[0, len(request.input_ids) :].tolist()
