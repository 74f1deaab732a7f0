"""Log probabilities: a decoded token's (`logprobs`, `top_logprobs` on both endpoints: `TokenLogprobs`), and a
prompt's (`/v1/completions` with `echo` and `logprobs`, as lm-eval's `local-completions` scores loglikelihood tasks,
and as OpenAI's legacy completions did: `score`).

A decoded token's log probability is read from the pass that decided it (`Runner.logprobs`), after the request's
processors and grammar: in lossless mode (and at τ = 1) the verifying pass's, which is plain decoding's at that token;
in τ-mode the slot's own, which for a mask's token is the mask's prediction, not what the model would give that token
after the tokens before it.

Such a request asks what the model thinks of text it is given, not for new text: one forward over the prompt gives,
at every token, its log probability under the model (`token_logprobs`, None for the first, which nothing predicts)
and the `logprobs` most likely tokens there (`top_logprobs`); with `max_tokens=1` the one new token is the greedy
next token, scored the same way. No MARS pass is involved: masks only change what is decoded, and nothing is. So
the numbers are the model's own, as `model(input_ids).logits` gives them (lm-eval's HF backend computes the same).
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

MAX_LOGPROBS = 20  # most alternatives per position (OpenAI's own limit for chat's top_logprobs)
_ONE_AT_A_TIME = threading.Lock()  # a forward of its own beside the engine's passes; two of them only compete


def asked_logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives a request asks for beside each decoded token's log probability (0 or more), or None
    where it asks for none. Chat: `logprobs` true, with `top_logprobs` 0 to 20; completions: `logprobs` 0 to 20. A
    `ValueError` naming a malformed value."""
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if asked is not None and not isinstance(asked, bool):
            raise ValueError(f"logprobs must be true or false, got {asked!r}")
        if top is not None and not (isinstance(top, int) and not isinstance(top, bool) and 0 <= top <= MAX_LOGPROBS):
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top!r}")
        if top and not asked:
            raise ValueError("top_logprobs needs logprobs=true")
        return (top or 0) if asked else None
    if asked is None or asked is False:
        return None
    if isinstance(asked, bool) or not isinstance(asked, int) or not 0 <= asked <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {asked!r}")
    return asked


class TokenLogprobs:
    """One request's decoded tokens' log probabilities: the engine appends `(token, logprob, top values, top ids)` to
    `entries` as it sends each token; the handler drains them into OpenAI's form, a whole answer's or each chunk's
    (a chunk carries the tokens decoded up to it), with the request's `top` alternatives."""

    def __init__(self, top: int, tokenizer):
        self.top, self.tokenizer = top, tokenizer
        self.entries: deque = deque()  # appended by the engine's thread, drained by the event loop's
        self.offset = 0  # completions' `text_offset` of the next token

    def drain(self) -> list[tuple]:
        out = []
        while self.entries:
            out.append(self.entries.popleft())
        return out

    def _tops(self, values, ids) -> list[tuple[int, float]]:
        """`(token, log probability)` of the request's `top` alternatives (a runner may record more, for another
        row)."""
        return list(zip((ids or [])[: self.top], (values or [])[: self.top]))

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def chat(self, entries: list[tuple]) -> dict:
        """Chat's `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs}]}`."""

        def one(token: int, logprob: float) -> dict:
            text = self._text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = [
            {**one(token, logprob), "top_logprobs": [one(i, v) for i, v in self._tops(values, ids)]}
            for token, logprob, values, ids in entries
        ]
        return {"content": content}

    def completion(self, entries: list[tuple]) -> dict:
        """Completions' legacy `logprobs`: `tokens`, `token_logprobs`, `top_logprobs` (text to log probability, of
        two tokens of one text the likelier) and `text_offset` (each token's start in the text)."""
        pieces = [self._text(token) for token, *_ in entries]
        tops = []
        for _, _, values, ids in entries:
            top: dict = {}
            for i, value in self._tops(values, ids):
                top.setdefault(self._text(i), value)
            tops.append(top)
        offsets = []
        for piece in pieces:
            offsets.append(self.offset)
            self.offset += len(piece)
        return {
            "tokens": pieces,
            "token_logprobs": [logprob for _, logprob, _, _ in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def scores_prompt(body: dict) -> bool:
    """Whether a completions request asks for its prompt's log probabilities: `echo=true`, `logprobs` a count, at most
    one new token (greedy), one choice, not streamed. Other uses of `echo` and `logprobs` stay refused by name."""
    top = body.get("logprobs")
    counted = isinstance(top, int) and not isinstance(top, bool) and 0 <= top <= MAX_LOGPROBS
    return (
        body.get("echo") is True
        and counted
        and body.get("max_tokens", 16) in (0, 1)
        and body.get("temperature") in (None, 0, 0.0)
        and body.get("n") in (None, 1)
        and body.get("best_of") in (None, 1)
        and not body.get("stream")
    )


def prompts_of(prompt, tokenizer) -> list[list[int]]:
    """The prompt field (a string, token ids, or a list of either) as token id lists, a string tokenized as the
    completions endpoint tokenizes it."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("prompt must be a string, a list of token ids, or a non-empty list of either")
    ids = [tokenizer(p)["input_ids"] if isinstance(p, str) else p for p in prompt]
    vocab = len(tokenizer)
    if not all(isinstance(p, list) and p and all(isinstance(t, int) and 0 <= t < vocab for t in p) for p in ids):
        raise ValueError(f"each prompt must be non-empty text or token ids in [0, {vocab})")
    return ids


@torch.inference_mode()
def score(model, tokenizer, body: dict, request_id: str, model_id: str) -> dict:
    """The completions response for `scores_prompt`'s request: one choice per prompt, its text the prompt and (with
    `max_tokens=1`) the greedy next token, with OpenAI's legacy `logprobs` object."""
    top, new = body["logprobs"], body.get("max_tokens", 16)
    prompts = prompts_of(body.get("prompt", ""), tokenizer)
    limit = getattr(model.config, "max_position_embeddings", None)
    choices = []
    for index, ids in enumerate(prompts):
        if limit and len(ids) > limit:
            raise ValueError(f"a prompt of {len(ids)} tokens exceeds the model's context ({limit})")
        with _ONE_AT_A_TIME:
            logits = model(input_ids=torch.tensor([ids], device=model.device), use_cache=False).logits[0]
        logprobs = logits.float().log_softmax(-1)
        tokens = ids + ([int(logprobs[-1].argmax())] if new else [])
        choices.append(_choice(tokenizer, index, tokens, logprobs, top))
    prompt_tokens = sum(len(ids) for ids in prompts)
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_id,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": new * len(prompts),
            "total_tokens": prompt_tokens + new * len(prompts),
        },
    }


def _choice(tokenizer, index: int, tokens: list[int], logprobs: torch.Tensor, top: int) -> dict:
    """One choice: each token's log probability given the tokens before it (the first has none), and the `top` most
    likely tokens at each position (by their text; of two tokens with one text, the likelier)."""
    chosen = logprobs[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].tolist()
    pieces = [tokenizer.decode([t]) for t in tokens]
    tops = [None] + [{} for _ in tokens[1:]]
    if top:
        best = logprobs[: len(tokens) - 1].topk(top, dim=-1)
        for position, (ids, values) in enumerate(zip(best.indices.tolist(), best.values.tolist()), start=1):
            for token, value in zip(ids, values):
                tops[position].setdefault(tokenizer.decode([token]), value)
    return {
        "index": index,
        "text": tokenizer.decode(tokens),
        "finish_reason": "length",
        "logprobs": {
            "tokens": pieces,
            "token_logprobs": [None] + chosen,
            "top_logprobs": tops,
            "text_offset": [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))],
        },
    }
