"""`hf-mars bench --structured`: JSON under schemas, plain constrained greedy decoding against lossless mode and τ-mode
under the same grammar (`hf_mars.grammar`), side by side in rounds that take turns.

Each output is parsed and validated against its schema; lossless mode's tokens are compared with plain constrained
greedy decoding's; the grammar's own time (the processor's calls) is reported apart from the whole.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ...grammar import GrammarProcessor

# Four kinds of schema an extraction pipeline asks for: a flat object, a nested one, an array of objects, enums.
# Strings and arrays are bounded, so every output ends within a budget (a weak model may otherwise write one string
# until its budget runs out: valid so far, never closed).
_NAME = {"type": "string", "maxLength": 24}
SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 150}, "city": _NAME},
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "title": _NAME,
            "author": {
                "type": "object",
                "properties": {"name": _NAME, "born": {"type": "integer", "minimum": 0, "maximum": 2100}},
                "required": ["name", "born"],
                "additionalProperties": False,
            },
        },
        "required": ["title", "author"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"name": _NAME, "price": {"type": "number", "minimum": 0, "maximum": 1000}},
                    "required": ["name", "price"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {
            "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "string", "enum": ["low", "medium", "high"]},
            "topic": _NAME,
        },
        "required": ["sentiment", "confidence", "topic"],
        "additionalProperties": False,
    },
}
_ASKS = {
    "flat": "Describe {} as a JSON object with the keys name, age and city.",
    "nested": "Give a famous book about {} as JSON: its title, and its author's name and year of birth.",
    "array": "List up to three things to buy for {} as JSON: an object whose `items` each have a name and a price.",
    "enum": 'Classify this review as JSON (sentiment, confidence, topic): "{}"',
}
_SUBJECTS = {
    "flat": ["a famous scientist", "a fictional detective", "a retired teacher", "a young painter",
             "an old sailor", "a chess champion", "a baker in Paris", "a startup founder"],
    "nested": ["the sea", "war", "love", "space travel", "mathematics", "a whale", "a detective", "childhood"],
    "array": ["a birthday party", "a camping trip", "a picnic", "a new kitchen", "a garden", "school",
              "a rainy day", "a long train ride"],
    "enum": ["The battery died after two days.", "Best pizza in town, friendly staff.", "It arrived on time.",
             "The plot was slow but the ending was great.", "Terrible customer service.", "Works as described.",
             "I would buy it again!", "The screen cracked in a week."],
}  # fmt: skip
METHODS = {"plain": {}, "lossless": {"mars_verify": True}, "tau=0.9": {"mars_tau": 0.9}}


def structured_prompts(tokenizer) -> list[dict]:
    """32 chat prompts (8 per schema): `{"schema", "text"}`."""
    rows = []
    for kind, subjects in _SUBJECTS.items():
        for subject in subjects:
            messages = [{"role": "user", "content": _ASKS[kind].format(subject)}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            rows.append({"schema": kind, "text": text})
    return rows


class TimedGrammar(GrammarProcessor):
    """A `GrammarProcessor` that adds up the time of its calls (`seconds`) and counts them."""

    seconds: float = 0.0
    calls: int = 0

    def __call__(self, input_ids, scores):
        start = time.perf_counter()
        try:
            return super().__call__(input_ids, scores)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


@dataclass
class Cell:
    method: str
    batch: int
    seconds: list[float] = field(default_factory=list)
    grammar_seconds: float = 0.0
    tokens: int = 0  # JSON's tokens, EOS and padding left out
    passes: int = 0  # the batches' forward passes
    row_tokens: int = 0  # tokens each row made (EOS in), and passes it took part in: tokens per pass, per row
    row_passes: int = 0
    valid: int = 0
    outputs: int = 0
    same_as_plain: int = 0
    texts: list[list[int]] = field(default_factory=list)

    def record(self, tokens: list[list[int]], counts: tuple, texts: list[str], schema: str) -> None:
        """One batch's outputs (`_decode`'s tokens and counts, the texts), all asked for under `schema`."""
        self.tokens += sum(len(t) for t in tokens)
        self.passes, self.row_tokens, self.row_passes = (a + b for a, b in zip(self.counts, counts))
        self.texts += tokens
        self.outputs += len(texts)
        self.valid += sum(_valid(text, SCHEMAS[schema]) for text in texts)

    @property
    def counts(self) -> tuple[int, int, int]:
        return self.passes, self.row_tokens, self.row_passes

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / statistics.median(self.seconds) if self.seconds else 0.0


def _valid(text: str, schema: dict) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    try:
        import jsonschema
    except ImportError:  # parsing is all that can be checked
        return True
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def _decode(model, tokenizer, rows: list[dict], method: str, max_new_tokens: int):
    """One batch of one schema, decoded by `method`: `(JSON tokens per row, seconds, grammar seconds, counts)`, counts
    `(forward passes, tokens the rows made, passes the rows took part in)`."""
    eos = model.generation_config.eos_token_id
    grammar = TimedGrammar.from_json_schema(SCHEMAS[rows[0]["schema"]], tokenizer, eos_token_id=eos)
    enc = tokenizer([r["text"] for r in rows], return_tensors="pt", padding=True, add_special_tokens=False)
    enc = enc.to(model.device)
    start = time.perf_counter()
    out = model.generate(
        **enc,
        logits_processor=[grammar],
        max_new_tokens=max_new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
        **METHODS[method],
    )
    seconds = time.perf_counter() - start
    new = out.sequences[:, enc["input_ids"].shape[1] :]
    pad = tokenizer.pad_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos)
    tokens = [[t for t in row if t != pad and t not in eos_ids] for row in new.tolist()]
    stats = getattr(out, "mars_stats", None)
    if stats is None:  # plain: one token a step, EOS included
        made = sum(sum(t != pad for t in row) for row in new.tolist())
        return tokens, seconds, grammar.seconds, (new.shape[1], made, made)
    counts = (stats.forward_passes, int(stats.new_tokens.sum()), int(stats.passes_per_row.sum()))
    return tokens, seconds, grammar.seconds, counts


def run_structured(model, tokenizer, batch_sizes, max_new_tokens: int, rounds: int) -> list[Cell]:
    """Every method at every batch size, `rounds` times in turns; the schemas' prompts in batches of one schema."""
    tokenizer.padding_side = "left"  # generate()'s layout for a batch
    prompts = structured_prompts(tokenizer)
    cells = {(m, b): Cell(m, b) for b in batch_sizes for m in METHODS}
    by_schema = [[r for r in prompts if r["schema"] == kind] for kind in SCHEMAS]
    batching = {b: [group[i : i + b] for group in by_schema for i in range(0, len(group), b)] for b in batch_sizes}
    progress = tqdm(total=rounds * len(METHODS) * sum(map(len, batching.values())), desc="structured", unit="batch")
    for round_ in range(rounds):
        for batch, batches in batching.items():
            for method in METHODS:
                cell, spent, grammar_total = cells[method, batch], 0.0, 0.0
                for rows in batches:
                    tokens, seconds, grammar_s, counts = _decode(model, tokenizer, rows, method, max_new_tokens)
                    spent, grammar_total = spent + seconds, grammar_total + grammar_s
                    progress.update()
                    if round_ == 0:  # what was decoded (each round's the same); each round's time
                        cell.record(tokens, counts, [tokenizer.decode(t) for t in tokens], rows[0]["schema"])
                cell.seconds.append(spent)
                cell.grammar_seconds += grammar_total / rounds
    progress.close()
    for (_, batch), cell in cells.items():
        plain = cells["plain", batch].texts
        cell.same_as_plain = sum(a == b for a, b in zip(cell.texts, plain))
    return list(cells.values())


def format_structured(cells: list[Cell]) -> str:
    """A table: per batch size and method, validity, agreement with plain, tokens per pass, tokens/s and its ratio to
    plain's, and the grammar's share of the time."""
    lines = [
        "| batch | method | valid JSON | same tokens as plain | tokens/pass | tokens/s | vs plain | grammar ms/pass |",
        "|---|---|---|---|---|---|---|---|",
    ]
    plain = {c.batch: c for c in cells if c.method == "plain"}
    for c in cells:
        base = plain[c.batch]
        per_pass = c.row_tokens / max(c.row_passes, 1)
        grammar_ms = 1e3 * c.grammar_seconds / max(c.passes, 1)
        lines.append(
            f"| {c.batch} | {c.method} | {c.valid}/{c.outputs} | {c.same_as_plain}/{c.outputs} | {per_pass:.2f} | "
            f"{c.tokens_per_second:.1f} | {c.tokens_per_second / base.tokens_per_second:.2f}x | {grammar_ms:.2f} |"
        )
    return "\n".join(lines)


def structured_table(model, tokenizer, batch_sizes, max_new_tokens: int = 128, rounds: int = 3) -> str:
    torch.manual_seed(0)
    return format_structured(run_structured(model, tokenizer, batch_sizes, max_new_tokens, rounds))
