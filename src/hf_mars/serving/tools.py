"""Tool calls (OpenAI's `tools` and `tool_choice`) as constrained decoding: what a call may say is a JSON schema, so
the engine decodes it under a `GrammarProcessor` (as `response_format`) and the answer carries the text as
`tool_calls`.

- `tool_choice` a named function: the text is that function's arguments, an object its `parameters` fix; streamed,
  each piece of it is an `arguments` delta of one call (the first delta names the function).
- `"required"`: the text is a JSON array of calls, `[{"name": ..., "arguments": {...}}, ...]`, each call one of the
  tools with its own parameters (one call with `parallel_tool_calls=false`); streamed, each call is sent whole as soon
  as its object closes.
- `"auto"` (the default with tools): the model chooses between text and calls, in the format its chat template
  writes calls in; transformers serve parses them. Served where the template renders `tools` and transformers knows
  how to read its calls back; refused by name elsewhere, where the model would never see the tools.
- `"none"`: no call; the tools are not shown to the model.

A function's arguments hold its parameters and no others (`additionalProperties` false where its schema does not say,
as OpenAI's strict functions require): a program calls the function with them.

The prompt is what the chat template makes of the messages and tools: a template that does not render tools shows
the model none, and only the grammar keeps its arguments to the schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from transformers.cli.serving.utils import get_response_template


@dataclass
class ToolCalls:
    """How one request's text becomes OpenAI tool calls: `name` set for a named function (the text is its
    arguments), None for `"required"` (the text is an array of calls). `streamed` follows a stream's text."""

    name: str | None = None
    request_id: str = ""  # the server's, for the calls' ids
    streamed: str = ""
    sent: int = 0  # calls sent whole so far ("required"), or 1 once the named call's first delta went
    _scan: int = field(default=0, repr=False)  # where the next call of the array starts in `streamed`

    def call(self, index: int, name: str, arguments: str) -> dict:
        function = {"name": name, "arguments": arguments}
        return {"index": index, "id": f"{self.request_id}_tool_call_{index}", "type": "function", "function": function}

    def whole(self, text: str) -> list[dict] | None:
        """The calls of a finished text (as the message's `tool_calls`, without `index`), or None where the text is
        not a whole call (a budget cut it short)."""
        if self.name is not None:
            try:
                json.loads(text)
            except ValueError:
                return None
            calls = [(self.name, text.strip())]
        else:
            try:
                calls = [(c["name"], json.dumps(c["arguments"])) for c in json.loads(text)]
            except (ValueError, TypeError, KeyError):
                return None
        return [{k: v for k, v in self.call(i, n, a).items() if k != "index"} for i, (n, a) in enumerate(calls)]

    def deltas(self, piece: str) -> list[dict]:
        """The `tool_calls` deltas a stream's next piece of text makes."""
        self.streamed += piece
        if self.name is not None:
            if not piece:
                return []
            first, self.sent = self.sent == 0, 1
            return [self.call(0, self.name, piece) if first else {"index": 0, "function": {"arguments": piece}}]
        out, decoder = [], json.JSONDecoder()
        while True:
            rest = self.streamed[self._scan :]
            start = len(rest) - len(rest.lstrip(" \t\n\r[,"))
            try:
                value, end = decoder.raw_decode(rest, start)
            except ValueError:  # the next call is not whole yet
                return out
            self._scan += end
            out.append(self.call(self.sent, value["name"], json.dumps(value["arguments"])))
            self.sent += 1


def tool_request(body: dict, processor, model) -> tuple[dict | None, ToolCalls | None]:
    """The JSON schema a chat request's `tool_choice` constrains its text to and how that text becomes calls, or
    `(None, None)` where it asks for no forced call. Drops the tools from `body` for `"none"`. A `ValueError` names
    what is malformed or not served."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise ValueError(f"tool_choice={choice!r} needs tools")
        return None, None
    functions = _functions(tools)
    if body.get("response_format") not in (None, {"type": "text"}) and choice not in (None, "auto", "none"):
        raise ValueError("a forced tool call and a response_format both fix the text: send one of them")
    if choice == "none":
        del body["tools"]
        return None, None
    if choice in (None, "auto"):
        if body.get("parallel_tool_calls") is False:
            raise ValueError(
                "parallel_tool_calls=false is served with tool_choice 'required' or a named function; with 'auto' the "
                "model's calls are read back as it writes them"
            )
        if not _renders_tools(processor, model):
            raise ValueError(
                "tool_choice='auto' (the default with tools) needs a chat template that renders tools and whose "
                "calls transformers can read back; this model's has none: ask for tool_choice='required' or a named "
                "function, whose calls the server constrains to the tools' schemas"
            )
        return None, None
    one = body.get("parallel_tool_calls") is False
    if choice == "required":
        calls = {"anyOf": [_call_schema(name, parameters) for name, parameters in functions.items()]}
        schema = {"type": "array", "items": calls, "minItems": 1, **({"maxItems": 1} if one else {})}
        return schema, ToolCalls()
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ValueError(
            f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': {{'name': ...}}}}, "
            f"got {choice!r}"
        )
    if name not in functions:
        raise ValueError(f"tool_choice names {name!r}, which is not one of the tools: {sorted(functions)}")
    return functions[name], ToolCalls(name=name)


def _functions(tools) -> dict[str, dict]:
    """Each tool's name and its parameters' schema (an object of no properties where it gives none)."""
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of {'type': 'function', 'function': {...}}")
    out = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"each tool must be {{'type': 'function', 'function': {{'name': ...}}}}, got {tool!r}")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise ValueError(f"tool {name!r}: parameters must be a JSON schema (an object)")
        if name in out:
            raise ValueError(f"two tools are named {name!r}")
        out[name] = {"additionalProperties": False, **parameters}  # as a strict function's: only its parameters
    return out


def _call_schema(name: str, parameters: dict) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _renders_tools(processor, model) -> bool:
    """Whether the model's chat template shows it the tools and transformers serve can parse its calls."""
    tokenizer = getattr(processor, "tokenizer", processor)
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    return "tools" in template and get_response_template(processor, model) is not None
