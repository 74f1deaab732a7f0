"""An OpenAI-compatible MARS server: transformers serve's app, loader and handlers, with three changes.

- Loading: transformers serve finds a model's class by the name in `config.architectures`, which a MARS checkpoint's
  remote class is not; `MARSModelManager` loads the weights as the base class and makes it this hf_mars's MARS class.
- Requests: `/v1/chat/completions` and `/v1/completions` take the `mars_*` settings as top-level fields (an OpenAI
  client's `extra_body`) or inside the `generation_config` JSON string transformers serve already reads; the
  checkpoint's generation config is the default. A setting `generate()` would refuse is answered with HTTP 400 and
  `generate()`'s own message, before anything is queued. `usage` gains `forward_passes` and `tokens_per_forward`.
- Generation: one `MARSEngine` (engine.py) decodes every request in one running MARS session, which requests join
  between passes and leave the moment they stop (continuous batching; transformers' own runs a paged-cache decoder
  where MARS does not run).
- Start: the server answers at once. Lossless mode's pass costs (`mars_lossless="auto"`) are timed in a thread of
  their own; until a batch size is timed its requests draft as what is known of this kind of device says
  (`costs.prior_costs`), their text the same either way.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections import OrderedDict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, CompileConfig, PretrainedConfig
from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.model_manager import ModelManager
from transformers.cli.serving.response import ResponseHandler
from transformers.cli.serving.server import build_server
from transformers.cli.serving.systemone import SystemOneHandler
from transformers.cli.serving.transcription import TranscriptionHandler
from transformers.cli.serving.utils import GenerationState, split_revision

from ..decoding.modeling import mars_class
from ..decoding.settings import SETTING_KEYS
from ..tools.checkpoints.loading import check_mars_config
from . import DEFAULT_CACHE_SLOTS
from .choices import CHOICES_KEY, check_best_of, check_choices, likeliest, merged_answer, merged_stream, merged_usage
from .load import check_tau_range
from .logprobs import TokenLogprobs, asked_logprobs, prompts_of, score, scores_prompt
from .tools import ToolCalls, tool_request

try:  # the serving extra: FastAPI, the OpenAI types, prometheus_client (the engine's metrics)
    from fastapi import HTTPException
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from openai.types.completion_usage import CompletionUsage

    from .engine import MARSEngine, measure_in_background
except ImportError as err:  # pragma: no cover - said once, where the server starts
    raise ImportError("hf-mars serve needs the serving extra: pip install 'hf_mars[serve]'") from err


class MARSModelManager(ModelManager):
    """transformers serve's model manager, loading a MARS checkpoint as the `hf-mars` commands do: its weights as the
    plain base class, which becomes this hf_mars's MARS class (the checkpoint's own remote code is not run, so one
    saved by an older hf_mars serves with every feature of this one: docs/remote-code.md)."""

    def __init__(self, *args, served_name: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.served_name = served_name or served_model_name(self.force_model)

    def list_models(self, cache_dir: str | None = None) -> list[dict]:
        """`/v1/models`: the served model under the name its clients use (`served_name`), not its path."""
        return [{**entry, "id": self.served_name} for entry in super().list_models(cache_dir)]

    def _load_model(self, model_id_and_revision: str, tqdm_class=None, progress_callback=None, gguf_file=None):
        if gguf_file is not None:
            raise ValueError("A MARS checkpoint is a transformers folder, not a GGUF file.")
        model_id, revision = split_revision(model_id_and_revision)
        config, _ = PretrainedConfig.get_config_dict(model_id, revision=revision)
        check_mars_config(config, model_id)
        model = AutoModelForCausalLM.from_pretrained(
            model_id, revision=revision, dtype=self.dtype, device_map=self.device
        )
        model.__class__ = mars_class(type(model))
        return model.eval()


class MARSGenerationState(GenerationState):
    """Every request of the served model goes to its one engine."""

    def __init__(self, engine: MARSEngine, compile: bool = False):
        super().__init__(continuous_batching=False, compile=compile)
        self.engine = engine

    def get_manager(self, model_id: str, use_cb: bool = False) -> MARSEngine:
        return self.engine

    def shutdown(self) -> None:
        self.engine.stop()


# OpenAI fields that transformers serve accepts and ignores (it logs a warning once), by the values that ask for
# nothing (of that type: `logprobs=0` asks for the chosen tokens' log probabilities): any other value would change
# what the client gets, so it is refused by name (HTTP 400), never dropped.
# Fields that change no token (`user`, `metadata`, `store`, `service_tier`, `stream_options`) pass as they do there.
ASKS_NOTHING = {
    "echo": (None, False),
    "presence_penalty": (None, 0, 0.0),
    "suffix": (None, ""),
    "reasoning_effort": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "audio": (None,),
    "functions": (None,),
    "function_call": (None,),
    "web_search_options": (None,),
}
WHY_NOT = {
    "echo": "only to score a prompt: echo=true with logprobs=k, max_tokens 0 or 1, temperature 0, not streamed",
    "presence_penalty": "use frequency_penalty (transformers' repetition penalty)",
    "suffix": "no fill-in-the-middle: the model would never see the suffix",
}


def refused_fields(body: dict) -> str | None:
    """Why the request is refused, naming each field whose value asks for what this server does not do, or None."""
    said = [
        f"{key}={body[key]!r} is not supported ({WHY_NOT.get(key, 'not implemented by hf-mars serve')})"
        for key, nothing in ASKS_NOTHING.items()
        if key in body and not any(body[key] == value and type(body[key]) is type(value) for value in nothing)
    ]
    return "; ".join(said) or None


class MARSRequests:
    """What MARS adds to a transformers serve handler: `mars_*` fields, checked as `generate()` checks them, OpenAI
    fields it would ignore refused by name, and MARS usage. Mixed in before the handler class."""

    chat = False  # which endpoint: its log probabilities' form

    def __init__(self, *args, model, engine: MARSEngine, **kwargs):
        super().__init__(*args, **kwargs)
        self.model, self.engine = model, engine
        self._streams: OrderedDict[str, TokenLogprobs] = OrderedDict()  # streams' log probabilities, by request id
        self.max_tokens = getattr(model.config, "max_position_embeddings", None) or 32768

    def _resolve_model(self, body: dict):
        """The served model, asked for by its served name (or, as transformers serve takes it, its path); answers
        name it by its served name."""
        manager = self.model_manager
        if body.get("model") == manager.served_name:
            body["model"] = manager.force_model
        _, model, processor = super()._resolve_model(body)
        return manager.served_name, model, processor

    def _validate_request(self, body: dict) -> None:
        asked = {key: value for key, value in body.items() if key not in SETTING_KEYS and key != CHOICES_KEY}
        super()._validate_request(asked)
        refused = refused_fields(body)
        if refused:
            raise HTTPException(status_code=400, detail=refused)

    async def handle_request(self, body: dict, request_id: str):
        body.pop(CHOICES_KEY, None)  # the server's own, never a client's
        try:
            n = check_choices(body.get("n"))
            best_of = n if self.chat else check_best_of(body.pop("best_of", None), n, bool(body.get("stream")))
        except ValueError as err:
            raise HTTPException(status_code=400, detail=str(err)) from err
        if best_of > 1:
            return await self._choices(body, request_id, n, best_of)
        return await self._one(body, request_id)

    async def _one(self, body: dict, request_id: str):
        """One choice, its usage with MARS's counts, and its tokens' log probabilities where asked."""
        scoring = self._scoring(body, request_id)
        try:
            response = await super().handle_request(body, request_id)
        finally:
            self.engine.scoring.pop(request_id, None)  # the engine took it, or the request never reached it
        if isinstance(response, JSONResponse):  # not streamed: the usage is in the body
            content = json.loads(response.body)
            if content.get("usage") is not None:
                content["usage"].update(self.engine.usage(request_id) or {})
            if scoring is not None and content.get("choices"):
                content["choices"][0]["logprobs"] = self._logprobs_of(scoring, scoring.drain())
            response = JSONResponse(
                content, headers={k: v for k, v in response.headers.items() if k != "content-length"}
            )
        elif scoring is not None:
            self._streams[request_id] = scoring
            while len(self._streams) > 4096:  # streams whose client left before their last chunk
                self._streams.popitem(last=False)
        return response

    def _scoring(self, body: dict, request_id: str) -> TokenLogprobs | None:
        """Where the request asks for its tokens' log probabilities, what the engine gives them to (registered for
        it by request id); else None. A 400 for a malformed ask, or one this server cannot answer."""
        try:
            top = asked_logprobs(body, self.chat)
        except ValueError as err:
            raise HTTPException(status_code=400, detail=str(err)) from err
        if top is None:
            return None
        self._validate_request(body)  # a field refused by name is said first
        scoring = self.engine.scoring[request_id] = TokenLogprobs(top, self.engine.tokenizer)
        return scoring

    def _logprobs_of(self, scoring: TokenLogprobs, entries: list) -> dict:
        return scoring.chat(entries) if self.chat else scoring.completion(entries)

    async def _choices(self, body: dict, request_id: str, n: int, best_of: int):
        """`n` choices: n requests of one, sent at once (rows of one batch), merged (choices.py); with `best_of`
        beyond n, that many, of which the n likeliest (their tokens' log probabilities asked for, shown only where
        the client asked)."""
        one = {key: value for key, value in body.items() if key != "n"}
        if body.get("seed") is not None:  # decoded as a batch of their own, seeded as it opens: reproducible
            one[CHOICES_KEY] = {"group": request_id, "n": best_of, "seed": body["seed"]}
        ranked = best_of > n
        if ranked and one.get("logprobs") is None:
            one["logprobs"] = 0  # each choice's own, to rank them by
        replies = await asyncio.gather(*(self._one(dict(one), f"{request_id}-{i}") for i in range(best_of)))
        if body.get("stream"):
            streams = [reply.body_iterator for reply in replies]
            return StreamingResponse(merged_stream(streams, request_id), media_type="text/event-stream")
        answers = [json.loads(reply.body) for reply in replies]
        if not ranked:
            return JSONResponse(merged_answer(answers))
        merged = merged_answer(likeliest(answers, n))
        if body.get("logprobs") is None:
            for choice in merged["choices"]:
                choice.pop("logprobs", None)
        if all(answer.get("usage") for answer in answers):
            merged["usage"] = merged_usage([answer["usage"] for answer in answers])
        return JSONResponse(merged)

    def _build_generation_config(self, body: dict, model_generation_config, use_cb: bool = False):
        try:
            bias = self._logit_bias(body.get("logit_bias"))
            config = super()._build_generation_config(
                {k: v for k, v in body.items() if k != "logit_bias"}, model_generation_config, use_cb=use_cb
            )
            if bias:
                config.sequence_bias = bias
            logprobs = asked_logprobs(body, self.chat)
            if logprobs is not None:  # the engine's runner records its tokens' (`Runner.logprobs`)
                config.token_logprobs = logprobs
            if body.get(CHOICES_KEY) is not None:  # the engine admits the group together (engine.py)
                config.choices_group = body[CHOICES_KEY]
            schema = response_schema(body.get("response_format"))
            if schema is not None:  # the engine's runner constrains its rows by it (`GrammarProcessor`)
                self._check_schema(schema)
                config.response_format = schema
            if all(body.get(key) is None for key in ("max_tokens", "max_completion_tokens")):
                config.max_new_tokens = min(config.max_new_tokens or self.max_tokens, self.max_tokens)  # a default
            fields = {key: body[key] for key in SETTING_KEYS if key in body}
            self._check(config, self._tau_range(config, fields))
        except (ValueError, TypeError) as err:  # what generate() would refuse, said before anything runs
            raise HTTPException(status_code=400, detail=str(err)) from err
        for key, value in fields.items():  # the engine reads them from the config
            setattr(config, key, value)
        return config

    def _check_schema(self, schema: dict) -> None:
        """A `ValueError` naming what is wrong with a response format's JSON schema, or why this server cannot follow
        one, before the request is queued."""
        from ..grammar import GrammarProcessor

        try:
            GrammarProcessor.from_json_schema(schema, self.engine.tokenizer)
        except ImportError as err:
            raise ValueError(f"response_format needs llguidance on the server: {err}") from err

    def _logit_bias(self, bias) -> dict | None:
        """OpenAI's `logit_bias` as `generate()`'s `sequence_bias` of single tokens, on either endpoint (transformers
        serve maps it for chat completions only, and takes no integer bias): token ids in the vocabulary, biases in
        [-100, 100], or a `ValueError` naming the entry."""
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must map token ids to biases, got {bias!r}")
        vocab, out = self.model.get_output_embeddings().weight.shape[0], {}
        for token, value in bias.items():
            if not str(token).isdigit() or int(token) >= vocab:
                raise ValueError(f"logit_bias: {token!r} is not a token id of this model (0 to {vocab - 1})")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise ValueError(f"logit_bias: token {token}'s bias must be a number in [-100, 100], got {value!r}")
            out[(int(token),)] = float(value)
        return out

    def _tau_range(self, config, fields: dict) -> dict:
        """A τ range (the request's `"mars_tau": [lo, hi]`, or the server's `--tau-range` for a request that sets no
        MARS field) is checked and put in `fields`, where the engine finds it; the fields to check the request's
        settings with are returned, the range's highest τ in its place."""
        given = fields.get("mars_tau", getattr(config, "mars_tau", None))
        if not fields and given is None and not getattr(config, "mars_verify", None) and self.engine.tau_range:
            given = list(self.engine.tau_range)
        if not isinstance(given, (list, tuple)):
            return fields
        lo, hi = check_tau_range(given)
        if fields.get("mars_verify", getattr(config, "mars_verify", None)):
            raise ValueError("mars_tau as a range is for τ-mode: lossless mode's text does not depend on τ")
        config.mars_tau, fields["mars_tau"] = None, [lo, hi]
        return {**fields, "mars_tau": hi}

    def _check(self, config, fields: dict) -> None:
        """Refuse what `generate(generation_config=config, **fields)` would refuse: the top-level fields are read as
        its keywords (a draft-tree field without a MARS mode is refused, not ignored)."""
        budget = config.max_new_tokens
        if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= self.max_tokens:
            raise ValueError(f"max_tokens must be an integer in [1, {self.max_tokens}], got {budget!r}")
        self.model.mars_settings(config, **fields)  # reads the cost table: a handler never times passes

    def _build_chunk_sse(self, request_id: str, *args, usage=None, **kwargs):
        if usage is not None:  # the stream's last chunk
            usage = CompletionUsage.model_validate({**usage.model_dump(), **(self.engine.usage(request_id) or {})})
        sse = super()._build_chunk_sse(request_id, *args, usage=usage, **kwargs)
        scoring = self._streams.get(request_id)
        if scoring is None or not sse or kwargs.get("role") is not None:
            return sse
        if kwargs.get("finish_reason") is not None:
            del self._streams[request_id]
        entries = scoring.drain()  # the tokens decoded up to this chunk
        if not entries:
            return sse
        chunk = json.loads(sse.removeprefix("data: "))
        chunk["choices"][0]["logprobs"] = self._logprobs_of(scoring, entries)
        return f"data: {json.dumps(chunk)}\n\n"


class MARSChatCompletionHandler(MARSRequests, ChatCompletionHandler):
    """`/v1/chat/completions` with MARS settings and forced tool calls (tools.py): a call's text is decoded under its
    schema's grammar, and answered as `tool_calls`."""

    chat = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._calls: OrderedDict[str, ToolCalls] = OrderedDict()  # by request id, until its answer is built

    async def _one(self, body: dict, request_id: str):
        try:
            schema, calls = tool_request(body, self.engine.tokenizer, self.model)
        except ValueError as err:
            raise HTTPException(status_code=400, detail=str(err)) from err
        if schema is None:
            return await super()._one(body, request_id)
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "tool_calls", "schema": schema}}
        calls.request_id, self._calls[request_id] = request_id, calls
        while len(self._calls) > 4096:  # streams whose client left before their last chunk
            self._calls.popitem(last=False)
        try:
            return await super()._one(body, request_id)
        except BaseException:
            self._calls.pop(request_id, None)
            raise

    def _build_completion(self, request_id: str, content: str, model_id: str, finish_reason: str, **kwargs):
        calls = self._calls.pop(request_id, None)
        made = calls.whole(content) if calls is not None else None
        if made is not None:  # else a budget cut the call short: its text is the answer, finish_reason "length"
            content, finish_reason, kwargs["tool_calls"] = None, "tool_calls", made
        return super()._build_completion(request_id, content, model_id, finish_reason, **kwargs)

    def _build_chunk_sse(self, request_id: str = "", content: str | None = None, **kwargs):
        calls = self._calls.get(request_id)
        if calls is not None and content is not None:
            deltas = calls.deltas(content)
            if not deltas:
                return ""  # a call not whole yet: nothing to send
            content, kwargs["tool_calls"] = None, deltas
        if calls is not None and kwargs.get("finish_reason") is not None:
            self._calls.pop(request_id, None)
            if kwargs["finish_reason"] == "stop" and calls.sent:
                kwargs["finish_reason"] = "tool_calls"
        return super()._build_chunk_sse(request_id, content=content, **kwargs)


class TokenPrompts:
    """`/v1/completions` with its prompt as token ids (OpenAI's API takes them; lm-eval's `local-completions` sends
    them), decoded from those ids exactly, where transformers serve takes text only. One prompt per request."""

    async def handle_request(self, body: dict, request_id: str):
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = body["prompt"] = prompt[0]  # a batch of one
        if not isinstance(prompt, list):
            return await super().handle_request(body, request_id)
        self._validate_request(body)
        model_id, model, processor = self._resolve_model(body)
        tokenizer = getattr(processor, "tokenizer", processor)
        try:
            prompts = prompts_of(prompt, tokenizer)
        except ValueError as err:
            raise HTTPException(status_code=400, detail=str(err)) from err
        if len(prompts) != 1:
            detail = "one prompt per request (send one request per prompt: they decode batched together)"
            raise HTTPException(status_code=400, detail=detail)
        ids = torch.tensor(prompts, device=model.device)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        config = self._build_generation_config(body, model.generation_config)
        manager = self.generation_state.get_manager(model_id)
        call = (model, processor, model_id, inputs, config, manager, body.get("suffix"))
        if body.get("stream"):
            return self._streaming(request_id, *call)
        return await self._non_streaming(request_id, *call)


class MARSCompletionHandler(MARSRequests, TokenPrompts, CompletionHandler):
    """`/v1/completions` with MARS settings, prompts as text or token ids, and a prompt's log probabilities (`echo`
    with `logprobs`: logprobs.py)."""

    async def handle_request(self, body: dict, request_id: str):
        if not scores_prompt(body):
            return await super().handle_request(body, request_id)
        asked = {key: value for key, value in body.items() if key not in ("echo", "logprobs")}
        self._validate_request(asked)
        if any(key in body for key in SETTING_KEYS):
            detail = "a prompt's log probabilities take no mars_* field: nothing is decoded"
            raise HTTPException(status_code=400, detail=detail)
        if body.get("n") not in (None, 1):
            raise HTTPException(status_code=400, detail="a prompt's log probabilities are one choice (n=1)")
        model_id, model, processor = self._resolve_model(body)
        tokenizer = getattr(processor, "tokenizer", processor)
        try:
            answer = await asyncio.to_thread(score, model, tokenizer, body, request_id, model_id)
        except ValueError as err:
            raise HTTPException(status_code=400, detail=str(err)) from err
        return JSONResponse(answer)


def response_schema(response_format) -> dict | None:
    """The JSON schema that OpenAI's `response_format` asks the text to follow: None for `text` (or none given), any
    JSON object for `json_object`, `json_schema.schema` for `json_schema` (followed strictly, `strict` or not). A
    `ValueError` naming what is malformed."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format json_schema needs `json_schema.schema`, a JSON schema (an object)")
        return spec["schema"]
    raise ValueError(f"response_format must have type text, json_object or json_schema, got {response_format!r}")


def served_model_name(model: str) -> str:
    """The name clients ask for a model by: a Hub repo id as it is, a local folder by its own name (not its path)."""
    path = Path(model)
    return path.name if path.is_dir() else model


def build_app(
    model: str,
    dtype: str = "auto",
    device: str = "auto",
    compile: bool = False,
    max_batch_size: int = 8,
    cache_slots: int = DEFAULT_CACHE_SLOTS,
    api_key: str | None = None,
    tau_range: tuple[float, float] | None = None,
    served_name: str | None = None,
    attention: str | None = None,
):
    """The FastAPI app serving `model` (a MARS checkpoint folder or Hub id), and its engine. `cache_slots`: the slots
    per row of the static cache that every pass decodes on, one graph (a `Runner`), compiled if `compile`. `api_key`:
    every endpoint but `/health` answers 401 to a request without `Authorization: Bearer <api_key>`. `tau_range`:
    the τ range of requests that set no MARS field (`"mars_tau": [lo, hi]`: τ chosen from the load, load.py).
    `served_name`: the model's name in `/v1/models` and in answers (default `served_model_name(model)`). `attention`:
    the attention implementation (default: the checkpoint's; `"ordered"`: a row's tokens whatever rows share its
    batch, `decoding/ordered_attention.py`)."""
    manager = MARSModelManager(device=device, dtype=dtype, force_model=str(model), served_name=served_name)
    loaded, tokenizer = manager.load_model_and_processor(manager.process_model_name(model))
    if attention is not None:
        loaded.set_attn_implementation(attention)
    compile_config = CompileConfig() if compile else None
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    engine = MARSEngine(
        loaded, tokenizer, max_batch_size, cache_slots=cache_slots, compile_config=compile_config, tau_range=tau_range
    )
    engine.metrics.model_name = manager.served_name
    engine.measuring = measure_in_background(loaded, max_batch_size, idle=engine.idle)
    state = MARSGenerationState(engine, compile=compile)
    shared = dict(model_manager=manager, generation_state=state)
    app = build_server(
        manager,
        MARSChatCompletionHandler(**shared, model=loaded, engine=engine),
        completion_handler=MARSCompletionHandler(**shared, model=loaded, engine=engine),
        response_handler=ResponseHandler(**shared),
        transcription_handler=TranscriptionHandler(manager, state),
        systemone_handler=SystemOneHandler(**shared),
        generation_state=state,
    )
    app.add_exception_handler(HTTPException, _openai_error)
    app.add_api_route("/metrics", lambda: _metrics(engine), methods=["GET"], include_in_schema=False)
    if api_key:
        require_key(app, api_key)
    return app, engine


def _metrics(engine: MARSEngine) -> Response:
    content, content_type = engine.metrics.render()
    return Response(content, media_type=content_type)


def require_key(app, api_key: str) -> None:
    """Let in only requests that carry `api_key` as a bearer token (as `vllm serve --api-key` does), except `/health`
    (a load balancer's probe) and CORS preflights (a browser sends those without credentials). A refusal is a 401 in
    OpenAI's error shape, which its clients raise as `AuthenticationError`; the key is compared in constant time and
    never written anywhere."""
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def check_key(request, call_next):
        if request.url.path == "/health" or request.method == "OPTIONS":
            return await call_next(request)
        given = request.headers.get("authorization", "").encode()
        if hmac.compare_digest(given, expected):
            return await call_next(request)
        message = "Incorrect or missing API key: send it as `Authorization: Bearer <key>`."
        body = {"error": {"message": message, "type": "invalid_request_error", "code": "invalid_api_key"}}
        return JSONResponse(body, status_code=401)


async def _openai_error(request, error: HTTPException) -> JSONResponse:
    """A refused request answers as OpenAI's API does (`error.message`, which its clients raise with), keeping
    FastAPI's `detail` for clients of transformers serve."""
    kind = "invalid_request_error" if error.status_code < 500 else "server_error"
    body = {"error": {"message": str(error.detail), "type": kind, "code": error.status_code}, "detail": error.detail}
    return JSONResponse(body, status_code=error.status_code, headers=error.headers)
