"""serving/tools.py: what a request's `tools` and `tool_choice` make of its text, without a server."""

from __future__ import annotations

import json

import pytest
from helpers import make_model, make_tokenizer

from hf_mars.serving.tools import ToolCalls, tool_request

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
TOOLS_TEMPLATE = (  # a Qwen-style template that shows the model its tools
    "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_named_function_is_its_parameters_and_required_an_array_of_calls():
    tok, model = make_tokenizer(), make_model("llama")
    schema, calls = tool_request({"tools": [WEATHER, CLOCK], "tool_choice": WEATHER}, tok, model)
    assert calls.name == "get_weather" and schema["properties"] == {"city": {"type": "string"}}
    assert schema["additionalProperties"] is False  # its parameters and no others
    schema, calls = tool_request({"tools": [WEATHER, CLOCK], "tool_choice": "required"}, tok, model)
    assert calls.name is None and schema["minItems"] == 1 and "maxItems" not in schema
    names = [option["properties"]["name"]["const"] for option in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    body = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    assert tool_request(body, tok, model)[0]["maxItems"] == 1
    none = {"tools": [WEATHER], "tool_choice": "none"}
    assert tool_request(none, tok, model) == (None, None) and "tools" not in none


def test_auto_is_served_only_where_the_template_renders_tools_and_its_calls_parse():
    """`"auto"` leaves the text to the model and transformers serve's parser: a Qwen model whose template renders
    tools passes; a llama template that shows none is refused by name."""
    tok, qwen = make_tokenizer(), make_model("qwen2")
    tok.chat_template = TOOLS_TEMPLATE
    assert tool_request({"tools": [WEATHER]}, tok, qwen) == (None, None)
    with pytest.raises(ValueError, match="needs a chat template that renders tools"):
        tool_request({"tools": [WEATHER]}, make_tokenizer(), make_model("llama"))


def test_streamed_pieces_become_call_deltas_that_add_up_to_the_whole_calls():
    """A named call streams each piece as an `arguments` delta (the first names it); required calls go whole as
    each object closes, however the text is cut into pieces."""
    named = ToolCalls(name="get_weather", request_id="r")
    text = '{"city": "Paris"}'
    deltas = [d for piece in (text[:3], text[3:9], text[9:]) for d in named.deltas(piece)]
    assert deltas[0]["function"]["name"] == "get_weather" and deltas[0]["id"] == "r_tool_call_0"
    assert "".join(d["function"]["arguments"] for d in deltas) == text
    assert named.whole(text) == [
        {"id": "r_tool_call_0", "type": "function", "function": {"name": "get_weather", "arguments": text}}
    ]
    calls = [{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "a]{,}"}}]
    text = json.dumps(calls, indent=1)
    for cut in range(1, 7):
        required = ToolCalls(request_id="r")
        pieces = [text[i : i + cut] for i in range(0, len(text), cut)]
        sent = [d for piece in pieces for d in required.deltas(piece)]
        assert [(d["index"], d["function"]["name"], json.loads(d["function"]["arguments"])) for d in sent] == [
            (i, c["name"], c["arguments"]) for i, c in enumerate(calls)
        ]
    assert [c["function"]["name"] for c in ToolCalls().whole(text)] == ["get_time", "get_weather"]
    assert ToolCalls().whole(text[:-3]) is None  # cut short: not a call


def test_auto_with_a_template_that_renders_tools_is_served_through_the_engine(tmp_path):
    """`tool_choice` "auto" on a served Qwen model whose template renders tools: answered (streamed and whole) as
    transformers serve parses a reply, its prompt the template's with the tools in it; a function that is not a tool
    is still a 400."""
    import httpx
    from helpers import serving

    from hf_mars import to_mars
    from hf_mars.serving.server import build_app

    tok, model = make_tokenizer(), make_model("qwen2")
    tok.chat_template = TOOLS_TEMPLATE
    to_mars(model, tok, block_size=4)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    app, engine = build_app(str(tmp_path), dtype="float32", device="cpu", max_batch_size=2)
    body = {"model": str(tmp_path), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    body["tools"] = [WEATHER]
    with serving(app) as url:
        whole = httpx.post(url + "/v1/chat/completions", json=body | {"tool_choice": "auto"}, timeout=120)
        assert whole.status_code == 200, whole.text
        assert whole.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
        with httpx.stream("POST", url + "/v1/chat/completions", json=body | {"stream": True}, timeout=120) as stream:
            assert stream.status_code == 200
            assert any(line.startswith("data:") for line in stream.iter_lines())
        wrong = {"tool_choice": {"type": "function", "function": {"name": "nope"}}}
        assert httpx.post(url + "/v1/chat/completions", json=body | wrong, timeout=60).status_code == 400
    shown = tok.apply_chat_template(body["messages"], tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert "get_weather" in shown  # the premise: this template shows the model its tools
    assert engine.finished and engine.finished[0]["tokens"] > 0
