"""Decontamination: whether a training prompt shares a word n-gram with a problem of the held-out evaluation sets
(GSM8K test and HumanEval, `eval_sets`).

`sourcing.build_prompt_mix` drops every prompt that shares a word n-gram (`NGRAM`) with one of them. No n catches
every rewrite, so the prompt sources are chosen by provenance first and this check is the second guard.
"""

from __future__ import annotations

import functools
import re

from ..evaluate.eval_sets import humaneval, olmo_task

# Word n-grams for the overlap check (`overlap`): long enough that common phrasing does not match, short enough to
# catch templated rewrites (GPT-3 used 13, PaLM 8). How 10 was chosen: docs/recipe.md.
NGRAM = 10


def _words(text: str) -> list[str]:
    """Lower-cased words and numbers; a run of numbers becomes one "0", since templated rewrites change numbers (and
    a list of numbers in a HumanEval docstring would otherwise match any list of numbers)."""
    words = []
    for word in re.findall(r"[a-z0-9]+", text.lower()):
        if word.isdigit():
            if words and words[-1] == "0":
                continue
            word = "0"
        words.append(word)
    return words


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    """The word n-grams of `text` after `_words`' normalisation."""
    words = _words(text)
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


@functools.cache
def eval_texts() -> tuple[str, ...]:
    """The evaluation problems as written in their datasets: GSM8K test questions and HumanEval prompts."""
    gsm8k = [d["question"] for d in olmo_task("gsm8k", "gold_bpb_5shot")]
    return tuple(gsm8k + [p["problem"]["prompt"] for p in humaneval()])


@functools.cache
def _ngram_set(texts: tuple[str, ...], n: int) -> frozenset:
    return frozenset(g for text in texts for g in ngrams(text, n))


def overlap(prompts: list[str], eval_texts: tuple[str, ...] | list[str], n: int = NGRAM) -> list[bool]:
    """For each prompt, whether it shares a word n-gram with any of `eval_texts` (as GPT-3's decontamination did).
    An evaluation text shorter than n words cannot be matched: GSM8K and HumanEval problems are all longer."""
    grams = _ngram_set(tuple(eval_texts), n)
    return [not grams.isdisjoint(ngrams(p, n)) for p in prompts]
