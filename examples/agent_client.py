"""What an agent asks of `hf-mars serve`, through the official openai client: JSON under a schema, a forced tool
call, token log probabilities, and several choices of one prompt. Start a server first:

    hf-mars serve                       # the shipped checkpoint, on http://127.0.0.1:8000
    python examples/agent_client.py     # or: python examples/agent_client.py --url http://HOST:PORT/v1

Every request decodes in lossless mode (`mars_verify`): the text is the model's own greedy text, MARS only makes it
faster. Set `--tau 0.9` to trade exactness for speed instead.
"""

from __future__ import annotations

import argparse
import json
import math

from openai import OpenAI

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL")
    parser.add_argument("--tau", type=float, help="τ-mode at this τ instead of lossless mode")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    client = OpenAI(base_url=args.url, api_key="-")
    model = client.models.list().data[0].id
    mode = {"mars_tau": args.tau} if args.tau is not None else {"mars_verify": True}

    def ask(content: str, extra: dict | None = None, **fields):
        messages = [{"role": "user", "content": content}]
        fields.setdefault("max_tokens", args.max_tokens)
        return client.chat.completions.create(
            model=model, messages=messages, extra_body=mode | (extra or {}), **fields
        )

    reply = ask(
        "Who wrote Hamlet, and how old did he live to be? Answer as JSON.",
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )
    text = reply.choices[0].message.content
    try:
        print("json:", json.dumps(json.loads(text)))  # on one line
    except ValueError:  # cut short by max_tokens (finish_reason "length")
        print("json (unfinished):", json.dumps(text))

    reply = ask("What's the weather in Paris?", tools=[WEATHER], tool_choice={"type": "function", "function": {
        "name": "get_weather"}})  # fmt: skip
    for call in reply.choices[0].message.tool_calls or []:  # its arguments: JSON of the function's parameters
        print("tool:", call.function.name, json.dumps(json.loads(call.function.arguments)))

    reply = ask("Name a primary color.", logprobs=True, top_logprobs=3, max_tokens=8)
    for entry in reply.choices[0].logprobs.content:
        others = ", ".join(f"{t.token!r} {math.exp(t.logprob):.2f}" for t in entry.top_logprobs)
        print(f"logprob: {entry.token!r} p={math.exp(entry.logprob):.3f} (top: {others})")

    sampled = {"generation_config": json.dumps({"do_sample": True})}  # transformers serve samples where it says so
    reply = ask("Give me a name for a cat.", extra=sampled, n=3, seed=0, temperature=0.8, max_tokens=12)
    for choice in reply.choices:
        print(f"choice {choice.index}:", json.dumps(choice.message.content))
    print("usage:", reply.usage.model_dump(exclude_none=True))


if __name__ == "__main__":
    main()
