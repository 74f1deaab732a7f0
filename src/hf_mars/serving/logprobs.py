"""A prompt's log probabilities: `/v1/completions` with `echo` and `logprobs`, as lm-eval's `local-completions` scores
loglikelihood tasks (and as OpenAI's legacy completions did).

Such a request asks what the model thinks of text it is given, not for new text: one forward over the prompt gives,
at every token, its log probability under the model (`token_logprobs`, None for the first, which nothing predicts)
and the `logprobs` most likely tokens there (`top_logprobs`); with `max_tokens=1` the one new token is the greedy
next token, scored the same way. No MARS pass is involved: masks only change what is decoded, and nothing is. So
the numbers are the model's own, as `model(input_ids).logits` gives them (lm-eval's HF backend computes the same).
"""

from __future__ import annotations

import threading
import time

import torch

MAX_LOGPROBS = 20  # most alternatives per position (OpenAI's own limit for chat's top_logprobs)
_ONE_AT_A_TIME = threading.Lock()  # a forward of its own beside the engine's passes; two of them only compete


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
