"""The quality–speed frontier of MARS's decoding rules (`hf-mars eval --frontier`): for each rule and setting, tokens
per forward pass against quality on the evaluation sets (GSM8K answer match, HumanEval pass@1, executed) and the
share of answers identical to greedy decoding's.

Rules: τ-mode (`mars_tau`), lossless mode with a draft tree (`mars_verify=True`: exact, so its answers are greedy's
in float32), typical acceptance on the same trees (`mars_accept="typical"`: more drafts kept, other answers), the
last two also sampled at a temperature. τ = 1 is greedy decoding itself and is always run: it is the reference.

A frontier over hundreds of problems takes hours on a CPU, so each setting's result is written to its own file as
soon as it is decoded, and a run that is stopped and started again (with the same sets, dtype, batch size and
budget) decodes only what is missing; `only` picks some of the settings. The table holds every setting in the
folder, and rows of earlier runs' frontier.json (another session, another machine) can join it: each row keeps its
share of answers identical to greedy's, so it needs no answers.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ...decoding.costs import pass_width, tree_key
from ..measure.plots import figure, save_figure
from ..measure.tables import markdown_table
from .evals import TASK_NAMES, decode_rows, same_share, score

RULES = ("τ-mode", "lossless", "typical")


@dataclass(frozen=True)
class Setting:
    """One decoding rule with its parameters: `generate()` kwargs and how the table names it."""

    rule: str
    label: str
    kwargs: dict = field(hash=False)
    width: int  # tokens in a pass at most (τ-mode: B; lossless: the full tree and its masks)

    @property
    def slug(self) -> str:
        keep = "".join(c if c.isalnum() or c in ".,+-" else "_" for c in f"{self.rule}_{self.label}")
        return keep.replace("τ", "tau")

    @property
    def sampled(self) -> bool:
        return bool(self.kwargs.get("do_sample"))


def frontier_settings(model, taus, trees, typical_trees, temperature: float | None) -> list[Setting]:
    """The settings to decode, greedy first: τ = 1 (the reference) and the other τ, lossless mode with each of
    `trees`, typical acceptance with each of `typical_trees`; then, where `temperature` is set, lossless and typical
    sampling with `typical_trees` at that temperature."""
    block = int(model.config.mars_block_size)
    settings = [
        Setting("τ-mode", f"τ = {tau:g}", dict(mars_tau=tau, mars_mask_cost=0.0), block)
        for tau in sorted({1.0, *taus}, reverse=True)
    ]
    for rule, chosen in (("lossless", trees), ("typical", typical_trees)):
        settings += [_tree_setting(rule, tree) for tree in chosen]
    if temperature:
        sampling = dict(do_sample=True, temperature=temperature)
        for rule in ("lossless", "typical"):
            settings += [_tree_setting(rule, tree, sampling) for tree in typical_trees]
    return list({s.slug: s for s in settings}.values())  # one chain per block size when sampled


def only(settings: list[Setting], names: list[str]) -> list[Setting]:
    """The settings named (τ = 1, the reference, always): by setting ("tau=0.8", "3x3+5") or, where lossless and
    typical share a tree, by rule and setting ("typical 3x3+5"); spaces and case aside, "tau" for τ."""
    key = lambda text: "".join(text.split()).lower().replace("τ", "tau")  # noqa: E731
    chosen = [settings[0]]
    for name in names:
        found = [s for s in settings if key(name) in (key(s.label), key(f"{s.rule} {s.label}"))]
        if len(found) != 1:
            known = ", ".join(f'"{s.rule} {s.label}"' for s in settings)
            problem = "matches no setting" if not found else "names settings of two rules"
            raise ValueError(f"--only {name!r} {problem}; the flags name: {known}")
        chosen += [s for s in found if s not in chosen]
    return chosen


def _tree_setting(rule: str, tree, sampling: dict | None = None) -> Setting:
    block, candidates, lookup = tree
    kwargs = dict(mars_verify=True, mars_tau=0.0, mars_block_size=block)
    kwargs.update(mars_draft_candidates=candidates, mars_lookup=lookup, mars_mask_cost=0.0)
    if rule == "typical":
        kwargs["mars_accept"] = "typical"
    label, width = tree_key(*tree), pass_width(*tree)
    if sampling:  # exact sampling verifies a chain only (speculative sampling); typical acceptance keeps the tree
        label += f", T = {sampling['temperature']:g}"
        if rule == "lossless":
            label, width = f"{block}x1, T = {sampling['temperature']:g}", pass_width(block, 1, 0)
        kwargs.update(sampling)
    return Setting(rule, label, kwargs, width)


def run_frontier(model, tokenizer, rows, settings, out, meta: dict, batch_size: int, max_new_tokens: int) -> list:
    """Decode every setting not yet in `out` (one file each, under out/settings), then return every result there
    whose run matches `meta` (the sets, dtype, budget): dicts of the setting, its figures and its answers."""
    folder = Path(out) / "settings"
    folder.mkdir(parents=True, exist_ok=True)
    meta = dict(meta, batch_size=batch_size, max_new_tokens=max_new_tokens)
    for setting in settings:
        path = folder / f"{setting.slug}.json"
        if path.exists() and json.loads(path.read_text())["meta"] == meta:
            continue
        torch.manual_seed(0)  # sampled settings: the same draws on every run
        decoded = decode_rows(model, tokenizer, rows, batch_size, max_new_tokens, setting.label, setting.kwargs)
        result = dict(asdict(setting), meta=meta, **score(rows, decoded.answers))
        result.update(tokens_per_forward=decoded.tokens_per_forward, per_task=decoded.per_task)
        result.update(tokens_per_second=decoded.tokens / max(decoded.seconds, 1e-9), answers=decoded.answers)
        path.write_text(json.dumps(result, indent=1))
        print(f"{setting.rule} {setting.label}: {decoded.tokens_per_forward:.2f} tokens/forward", flush=True)
    found = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    return _with_agreement(_ordered([r for r in found if r["meta"] == meta]))


def _ordered(results: list[dict]) -> list[dict]:
    """Greedy before sampled, by rule, then by tokens per forward."""
    rank = {rule: i for i, rule in enumerate(RULES)}
    key = lambda r: (r["kwargs"].get("do_sample", False), rank[r["rule"]], r["tokens_per_forward"])  # noqa: E731
    return sorted(results, key=key)


def _with_agreement(results: list[dict]) -> list[dict]:
    """Each result with `same_as_greedy`: the percent of its answers identical to τ = 1's (greedy decoding's), so
    that a row written to frontier.json keeps it without its answers."""
    greedy = (r for r in results if r["rule"] == "τ-mode" and r["kwargs"]["mars_tau"] >= 1)
    reference = next((r["answers"] for r in greedy), None)
    for r in results:
        r["same_as_greedy"] = same_share(r["answers"], reference)
    return results


JOIN_KEYS = ("model", "gsm8k", "humaneval", "dtype", "batch_size", "max_new_tokens")


def earlier_rows(frontier_json: str | Path, meta: dict) -> list[dict]:
    """The rows of an earlier run's frontier.json, each with the meta of the run that decoded it. That run must have
    decoded the same sets with the same model, dtype, batch size and budget as `meta` says."""
    data = json.loads(Path(frontier_json).read_text())
    differ = [k for k in JOIN_KEYS if data["meta"].get(k) != meta.get(k)]
    if differ:
        theirs = ", ".join(f"{k}={data['meta'].get(k)} (here {meta.get(k)})" for k in differ)
        raise ValueError(f"{frontier_json} is another frontier: {theirs}")
    return [dict(r, meta=r.get("meta", data["meta"])) for r in data["rows"]]


def join(results: list[dict], rows: list[dict]) -> list[dict]:
    """`results` and, for each setting they lack, the first of `rows` (`earlier_rows`) that holds it."""
    have = {(r["rule"], r["label"]) for r in results}
    added = []
    for r in rows:
        if (r["rule"], r["label"]) not in have:
            have.add((r["rule"], r["label"]))
            added.append(r)
    return _ordered(results + added)


def format_frontier(results: list[dict]) -> str:
    """One row per setting: pass width, tokens per forward (all, per set), share of answers identical to greedy's,
    each set's score, tokens per second at the run's batch size."""
    tasks = [t for t in TASK_NAMES if any(t in r for r in results)]
    head = ["rule", "setting", "pass width", "tokens/forward"] + [f"tok/fwd {TASK_NAMES[t].split()[0]}" for t in tasks]
    head += ["same as greedy"] + [TASK_NAMES[t] for t in tasks] + ["tokens/s"]
    rows = []
    for r in results:
        same = "" if r.get("same_as_greedy") is None else f"{r['same_as_greedy']:.0f}%"
        cells = [r["rule"], r["label"], str(r["width"]), f"{r['tokens_per_forward']:.2f}"]
        cells += [f"{r['per_task'].get(t, 0):.2f}" for t in tasks] + [same]
        cells += [f"{r[t]:.1f}%" if t in r else "" for t in tasks] + [f"{r['tokens_per_second']:.1f}"]
        rows.append(cells)
    return markdown_table(head, rows)


def save_frontier_plot(results: list[dict], path: str | Path, title: str) -> Path:
    """frontier.png: each set's score against tokens per forward, one line per rule (sampled rules dashed), and the
    share of answers identical to greedy's likewise; each point named by its setting, every axis from 0 (percents)."""
    tasks = [t for t in TASK_NAMES if any(t in r for r in results)]
    panels = [(TASK_NAMES[t], lambda r, t=t: r.get(t)) for t in tasks]
    if any(r.get("same_as_greedy") is not None for r in results):
        panels.append(("same as greedy (%)", lambda r: r.get("same_as_greedy")))
    plt, fig, axes = figure([name for name, _ in panels], "tokens per forward", "The frontier's plot needs matplotlib")
    for ax, (_, value) in zip(axes, panels):
        for sampled in (False, True):
            for rule in RULES:
                line = [r for r in results if r["rule"] == rule and bool(r["kwargs"].get("do_sample")) == sampled]
                if line:
                    xs = [r["tokens_per_forward"] for r in line]
                    label = rule + (", sampled" if sampled else "")
                    ys = [value(r) for r in line]
                    ax.plot(xs, ys, "--o" if sampled else "-o", label=label)
                    for i, (r, x, y) in enumerate(zip(line, xs, ys)):  # names above and below in turn
                        name, below = r["label"].replace(" = ", "="), i % 2
                        ax.annotate(
                            name, (x, y), xytext=(3, -9 if below else 3), textcoords="offset points", fontsize=6
                        )
        ax.set_ylim(0, ax.get_ylim()[1] * 1.1)  # room above the top point's name
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    save_figure(plt, fig, path)
    return Path(path)


def write_frontier(results: list[dict], out: str | Path, meta: dict, title: str) -> list[Path]:
    """frontier.md (the table), frontier.json (meta and the rows with their share of answers identical to greedy's,
    small enough to keep and to join to a later run; the answers stay in settings/) and frontier.png (matplotlib)."""
    out = Path(out)
    text = format_frontier(results)
    joined = lambda r: "answers" not in r  # noqa: E731  (a joined row keeps its own run's meta)
    rows = [{k: v for k, v in r.items() if k != "answers" and (k != "meta" or joined(r))} for r in results]
    (out / "frontier.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, ensure_ascii=False))
    (out / "frontier.md").write_text(text + "\n")
    written = [out / "frontier.md", out / "frontier.json"]
    try:
        written.append(save_frontier_plot(results, out / "frontier.png", title))
    except ImportError as err:
        print(f"no frontier.png: {err}")
    return written
