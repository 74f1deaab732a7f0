"""Structured outputs: a grammar (a JSON schema, any JSON object, a regex, a Lark grammar) as a logits processor.

    constrain = GrammarProcessor.from_json_schema(schema, tokenizer)
    model.generate(**inputs, logits_processor=[constrain])                      # plain constrained decoding
    model.generate(**inputs, logits_processor=[constrain], mars_verify=True)    # lossless: the same text
    model.generate(**inputs, logits_processor=[constrain], mars_tau=0.9)        # τ-mode

Why a logits processor: `generate()` applies it as it is, and MARS calls a processor on each slot of a pass with the
history that slot would continue (`decoding/scoring.py`'s `Histories`): τ-mode's mask i sees the tokens chosen at
the slots before it, so a mask's token is taken only where the grammar allows it after them; lossless mode
verifies each draft against the grammar-masked argmax after the drafts on its path, so its text is plain constrained
greedy decoding's. A token the grammar alone allows is chosen with confidence 1.

The grammar engine is llguidance (the `structured` extra), chosen by measuring against xgrammar on this project's
shapes (docs/benchmarks.md): both mask a slot in microseconds, and llguidance installs with no dependencies.

The processor's scores are a function of each row's history alone (MARS may call it for any slot, any number of
times: `decoding/scoring.py`'s `STATELESS`). For speed it keeps one matcher per row: a history that continues what
the matcher consumed costs only the new tokens, one that leaves it rolls the matcher back to where they part.
"""

from __future__ import annotations

import json
import weakref

import torch
from transformers import LogitsProcessor

# JSON's whitespace between tokens, bounded: a model may otherwise write whitespace until its budget runs out (valid
# JSON never closed). A schema's own "x-guidance" options override it.
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,32}"}
# llguidance tokenizers by (tokenizer, vocabulary size, EOS tokens): building one reads the whole vocabulary (~1 s)
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch  # noqa: F401 - the bitmask helpers
    except ImportError as err:
        raise ImportError("Structured outputs need llguidance: pip install 'hf_mars[structured]'") from err
    return llguidance


class GrammarProcessor(LogitsProcessor):
    """Bars every token the grammar does not allow after a row's generated tokens (its scores set to -inf); once the
    grammar is complete, EOS is allowed, and once nothing more can follow, only EOS. A row whose history the grammar
    does not accept (a finished row's padding) keeps its scores: `generate()` drops them.

    `grammar`: llguidance's grammar string (`llguidance.LLMatcher.grammar_from_json_schema`, `..._from_regex`,
    `..._from_lark`, or its JSON form); the class methods build one. `eos_token_id`: the tokens that end a row
    (default the tokenizer's; `generate()`'s own when they differ, such as a chat model's end of turn)."""

    mars_stateless = True  # scores a function of the history alone: MARS may call it for every slot of a pass

    def __init__(self, grammar: str, tokenizer, eos_token_id: int | list[int] | None = None):
        llguidance = _llguidance()
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"Invalid grammar: {error}")
        self.grammar, self.tokenizer = grammar, tokenizer
        eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        self.eos = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        # Where each row's generated tokens begin: None, the width of the first call (plain `generate()`'s
        # left-padded prompts); a column, or one per row, where MARS says so as rows join and leave its batch
        # (`scoring.follow_padding`)
        self.prompt_length: int | torch.Tensor | None = None
        self._prompt: torch.Tensor | None = None  # the prompts of the generation the matchers follow
        self._matchers: list = []
        self._consumed: list[list[int]] = []  # each row's generated tokens its matcher has consumed

    @classmethod
    def from_json_schema(cls, schema: dict | str, tokenizer, **kwargs) -> GrammarProcessor:
        """JSON that validates against `schema` (a dict or its JSON text). A schema that is not JSON, or that
        llguidance cannot compile, raises `ValueError` naming the problem."""
        llguidance = _llguidance()
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as err:
                raise ValueError(f"The JSON schema is not JSON: {err}") from err
        if not isinstance(schema, dict):
            raise ValueError(f"A JSON schema is a JSON object, got {type(schema).__name__}")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        return cls(grammar, tokenizer, **kwargs)

    @classmethod
    def json_object(cls, tokenizer, **kwargs) -> GrammarProcessor:
        """Any JSON object (OpenAI's `response_format={"type": "json_object"}`)."""
        return cls.from_json_schema({"type": "object"}, tokenizer, **kwargs)

    @classmethod
    def from_regex(cls, regex: str, tokenizer, **kwargs) -> GrammarProcessor:
        return cls(_llguidance().LLMatcher.grammar_from_regex(regex), tokenizer, **kwargs)

    @classmethod
    def from_lark(cls, lark: str, tokenizer, **kwargs) -> GrammarProcessor:
        return cls(_llguidance().LLMatcher.grammar_from_lark(lark), tokenizer, **kwargs)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows, vocab = scores.shape
        starts = self._follow(input_ids, vocab)
        bitmask = torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)  # every token, where not filled
        fill = _llguidance().torch.fill_next_token_bitmask
        for row, (ids, start) in enumerate(zip(input_ids.tolist(), starts)):
            if self._reach(row, ids[start:]):
                fill(self._matchers[row], bitmask, row)
        return _masked(scores, bitmask)

    def _follow(self, input_ids: torch.Tensor, vocab: int) -> list[int]:
        """Where each row's generated tokens begin, with a matcher for every row. Without a `prompt_length`, new
        matchers where `input_ids` starts another generation (other prompts, or none seen yet), whose width is then
        where they begin."""
        rows, known = input_ids.shape[0], self.prompt_length
        if known is not None:
            starts = known.tolist() if isinstance(known, torch.Tensor) else [int(known)] * rows
        else:
            if not self._continues(input_ids):
                self._prompt, self._matchers, self._consumed = input_ids.detach().cpu().clone(), [], []
            starts = [self._prompt.shape[1]] * rows
        while len(self._matchers) < rows:  # rows that joined: matchers of their own
            matcher = _llguidance().LLMatcher(self._lltokenizer(vocab), self.grammar, log_level=0)
            if matcher.is_error():
                raise ValueError(f"Invalid grammar: {matcher.get_error()}")
            self._matchers.append(matcher)
            self._consumed.append([])
        return starts

    def _continues(self, input_ids: torch.Tensor) -> bool:
        """Whether `input_ids` continues the generation the matchers follow: the same prompts."""
        prompt = self._prompt
        if prompt is None or input_ids.shape[0] != prompt.shape[0] or input_ids.shape[1] < prompt.shape[1]:
            return False
        return torch.equal(input_ids[:, : prompt.shape[1]].cpu(), prompt)

    def _lltokenizer(self, vocab: int):
        """llguidance's tokenizer for this vocabulary size (the model's, which may pass the tokenizer's), built once
        per tokenizer."""
        built = _TOKENIZERS.setdefault(self.tokenizer, {})
        key = (vocab, self.eos)
        if key not in built:
            built[key] = _llguidance().hf.from_tokenizer(self.tokenizer, n_vocab=vocab, eos_token=list(self.eos))
        return built[key]

    def _reach(self, row: int, history: list[int]) -> bool:
        """Move row `row`'s matcher to the end of `history` (its generated tokens): `_walk`."""
        return _walk(self._matchers[row], self._consumed[row], history)


class RowGrammars(GrammarProcessor):
    """Each row its own grammar, or none: a server's batch, whose requests ask for other schemas, or for none. The
    caller says which row holds which (`assign`, whenever rows join or leave the batch) by keys that outlive a row's
    place in it; a row without a grammar keeps its scores. Its rows' generated tokens begin where MARS says
    (`prompt_length`, `scoring.follow_padding`)."""

    def __init__(self, tokenizer, eos_token_id: int | list[int] | None = None):
        self.grammar, self.tokenizer = None, tokenizer
        eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        self.eos = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        self.prompt_length: int | torch.Tensor | None = None
        self._row_grammars: list[tuple[object, str | None]] = []  # each row's key and grammar (None: free)
        self._by_key: dict = {}  # a row's matcher and the tokens it consumed, by its key

    def assign(self, rows: list[tuple[object, str | None]]) -> None:
        """Row i (of the batch the next calls score) is `rows[i]`: `(key, grammar or None)`. Matchers of keys gone
        are dropped; a key's matcher stays with it wherever its row moves."""
        self._row_grammars = list(rows)
        keys = {key for key, _ in rows}
        for key in [key for key in self._by_key if key not in keys]:
            del self._by_key[key]

    @property
    def constrains(self) -> bool:
        """Whether any row has a grammar."""
        return any(grammar is not None for _, grammar in self._row_grammars)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows, vocab = scores.shape
        known = self.prompt_length if self.prompt_length is not None else input_ids.shape[1]
        starts = known.tolist() if isinstance(known, torch.Tensor) else [int(known)] * rows
        bitmask = torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)
        fill, filled = _llguidance().torch.fill_next_token_bitmask, False
        for row, (ids, start) in enumerate(zip(input_ids.tolist(), starts)):
            key, grammar = self._row_grammars[row] if row < len(self._row_grammars) else (None, None)
            if grammar is None:
                continue
            if key not in self._by_key:
                matcher = _llguidance().LLMatcher(self._lltokenizer(vocab), grammar, log_level=0)
                self._by_key[key] = (matcher, [])
            matcher, consumed = self._by_key[key]
            if _walk(matcher, consumed, ids[start:]):
                fill(matcher, bitmask, row)
                filled = True
        return _masked(scores, bitmask) if filled else scores


def _masked(scores: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`scores` at -inf wherever `bitmask` (llguidance's: a bit per token, 32 to an int) bars the token."""
    rows, vocab = scores.shape
    allowed = ((bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).view(rows, -1)[:, :vocab]
    return scores.masked_fill(~allowed.bool().to(scores.device), float("-inf"))


def _walk(matcher, consumed: list[int], history: list[int]) -> bool:
    """Move `matcher` (which consumed `consumed`) to the end of `history` (a row's generated tokens): back to where
    they part, then on. Whether the grammar accepts all of `history`."""
    same = len(consumed)
    if history[:same] != consumed:  # it parts from what was consumed (else, as most calls: it goes on from it)
        same = next(i for i, (a, b) in enumerate(zip(consumed, history + [None])) if a != b)
    if same < len(consumed):
        matcher.rollback(len(consumed) - same)
        del consumed[same:]
    new = history[same:]
    if not new:
        return True
    valid = matcher.validate_tokens(new)
    if valid:
        matcher.consume_tokens(new[:valid])
        consumed.extend(new[:valid])
    return valid == len(new)
