"""`hf-mars eval --frontier` (tools/evaluate/frontier.py): every decoding rule's tokens per forward against quality,
resumable setting by setting; on a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_evals import PNG, ROWS, rows_of, sharp_mars

from hf_mars.tools.evaluate import frontier
from hf_mars.tools.evaluate.frontier import (
    earlier_rows,
    format_frontier,
    frontier_settings,
    join,
    only,
    run_frontier,
    write_frontier,
)

META = dict(model="tiny", gsm8k=2, humaneval=1, dtype="float32", device="cpu")
TREE, WIDE = (2, 2, 2), (4, (3, 2), 3)


def run(model, tok, out, settings, batch_size=2):
    return run_frontier(model, tok, ROWS, settings, out, META, batch_size=batch_size, max_new_tokens=10)


def test_settings_cover_every_rule_with_greedy_as_the_reference():
    model, _ = sharp_mars()
    settings = frontier_settings(model, [0.9, 0.7], [TREE, WIDE], [TREE], temperature=0.7)
    names = [(s.rule, s.label) for s in settings]
    assert names[:3] == [("τ-mode", "τ = 1"), ("τ-mode", "τ = 0.9"), ("τ-mode", "τ = 0.7")]  # τ = 1 always
    assert ("lossless", "4x3,2+3") in names and ("typical", "2x2+2") in names
    sampled = [s for s in settings if s.sampled]
    # Exact sampling verifies a chain; typical sampling keeps the tree
    assert [(s.rule, s.label, s.width) for s in sampled] == [
        ("lossless", "2x1, T = 0.7", 4),
        ("typical", "2x2+2, T = 0.7", 10),
    ]
    assert len({s.slug for s in settings}) == len(settings)  # one file each
    assert frontier_settings(model, [], [], [], temperature=0)[0].kwargs["mars_tau"] == 1.0
    two = frontier_settings(model, [], [], [TREE, (2, 3, 0)], temperature=0.7)  # same block: one sampled chain
    assert [s.label for s in two if s.rule == "lossless"] == ["2x1, T = 0.7"]


def test_only_decodes_the_settings_named_and_the_reference():
    model, _ = sharp_mars()
    settings = frontier_settings(model, [0.8], [TREE], [TREE, WIDE], temperature=0.7)
    chosen = only(settings, ["tau=0.8", "lossless 2x1, T=0.7", "Typical 4X3,2+3", "4x3,2+3,T=0.7"])
    assert [(s.rule, s.label) for s in chosen] == [
        ("τ-mode", "τ = 1"),
        ("τ-mode", "τ = 0.8"),
        ("lossless", "2x1, T = 0.7"),
        ("typical", "4x3,2+3"),
        ("typical", "4x3,2+3, T = 0.7"),
    ]
    assert only(settings, ["τ = 1"]) == settings[:1]
    with pytest.raises(ValueError, match="names settings of two rules.*lossless 2x2\\+2"):
        only(settings, ["2x2+2"])
    with pytest.raises(ValueError, match="'3x9' matches no setting"):
        only(settings, ["3x9"])


def test_the_frontier_table_holds_each_rule_and_exact_rules_keep_greedy_answers(tmp_path):
    model, tok = sharp_mars()
    settings = frontier_settings(model, [0.0], [TREE, WIDE], [WIDE], temperature=0)
    results = run(model, tok, tmp_path, settings)
    by_name = {(r["rule"], r["label"]): r for r in results}
    greedy = by_name[("τ-mode", "τ = 1")]
    assert greedy["tokens_per_forward"] == 1.0
    for tree in ("2x2+2", "4x3,2+3"):  # lossless: exactly greedy's answers, in fewer passes
        assert by_name[("lossless", tree)]["answers"] == greedy["answers"]
    assert by_name[("lossless", "4x3,2+3")]["tokens_per_forward"] > 1.0
    assert by_name[("τ-mode", "τ = 0")]["tokens_per_forward"] > 1.0
    head, body = rows_of(format_frontier(results))
    assert head[:4] == ["rule", "setting", "pass width", "tokens/forward"] and "same as greedy" in head
    assert len(body) == len(settings)
    rows = {(cells[0], cells[1]): cells for cells in body}
    assert rows[("lossless", "2x2+2")][head.index("same as greedy")] == "100%"
    assert rows[("lossless", "4x3,2+3")][head.index("pass width")] == "40"
    written = write_frontier(results, tmp_path, META, "tiny")
    assert [p.name for p in written] == ["frontier.md", "frontier.json", "frontier.png"]
    assert (tmp_path / "frontier.png").read_bytes()[:8] == PNG
    data = json.loads((tmp_path / "frontier.json").read_text())
    assert len(data["rows"]) == len(settings) and all("answers" not in row for row in data["rows"])


def test_a_stopped_frontier_resumes_where_it_stopped(tmp_path, monkeypatch):
    model, tok = sharp_mars()
    first = frontier_settings(model, [], [TREE], [], temperature=0)
    run(model, tok, tmp_path, first)
    decoded = []
    real = frontier.decode_rows
    monkeypatch.setattr(frontier, "decode_rows", lambda *a, **k: decoded.append(a[5]) or real(*a, **k))
    more = frontier_settings(model, [0.5], [TREE], [TREE], temperature=0)
    results = run(model, tok, tmp_path, more)
    assert decoded == ["τ = 0.5", "2x2+2"] and len(results) == 4  # only what was missing; the table has all
    decoded.clear()
    assert len(run(model, tok, tmp_path, more, batch_size=3)) == 4  # another run's files are not mixed in
    assert len(decoded) == 4


def test_rows_of_an_earlier_run_join_the_table_with_their_share_of_greedy_answers(tmp_path):
    model, tok = sharp_mars()
    earlier = run(model, tok, tmp_path / "a", frontier_settings(model, [0.0], [], [], temperature=0))
    write_frontier(earlier, tmp_path / "a", dict(META, batch_size=2, max_new_tokens=10, threads=1), "a")
    later = run(model, tok, tmp_path / "b", frontier_settings(model, [], [TREE], [], temperature=0))
    meta = dict(META, batch_size=2, max_new_tokens=10)
    results = join(later, earlier_rows(tmp_path / "a" / "frontier.json", meta))
    assert [(r["rule"], r["label"]) for r in results] == [
        ("τ-mode", "τ = 1"),  # this run's, not the earlier one's
        ("τ-mode", "τ = 0"),
        ("lossless", "2x2+2"),
    ]
    assert "answers" in results[0] and "answers" not in results[1]
    head, body = rows_of(format_frontier(results))
    same = {cells[1]: cells[head.index("same as greedy")] for cells in body}
    first = dict((cells[1], cells[head.index("same as greedy")]) for cells in rows_of(format_frontier(earlier))[1])
    assert same["τ = 0"] == first["τ = 0"] and same["2x2+2"] == "100%"
    written = write_frontier(results, tmp_path / "b", dict(meta, threads=1), "b")
    assert (tmp_path / "b" / "frontier.png").read_bytes()[:8] == PNG and len(written) == 3
    data = json.loads((tmp_path / "b" / "frontier.json").read_text())
    assert "answers" not in data and [r["same_as_greedy"] for r in data["rows"]][::2] == [100.0, 100.0]
    assert [r.get("meta", {}).get("threads") for r in data["rows"]] == [None, 1, None]  # it keeps its run's meta
    again = join(later, earlier_rows(tmp_path / "b" / "frontier.json", meta))
    assert again[1]["same_as_greedy"] == results[1]["same_as_greedy"]
    with pytest.raises(ValueError, match="batch_size=2 \\(here 4\\)"):
        earlier_rows(tmp_path / "a" / "frontier.json", dict(meta, batch_size=4))


def test_sampled_settings_draw_the_same_on_every_run(tmp_path):
    model, tok = sharp_mars()
    settings = [s for s in frontier_settings(model, [], [], [TREE], temperature=0.7) if s.sampled]
    once = run(model, tok, tmp_path / "a", settings)
    again = run(model, tok, tmp_path / "b", settings)
    assert [r["answers"] for r in once] == [r["answers"] for r in again]


CLI_CASES = [
    ([], None),
    (["--base"], "drop --base"),
    (["--only", "tau=0.5"], None),
    (["--only", "2x2"], "names settings of two rules"),
    (["--join", "missing.json"], "missing.json"),
]


@pytest.mark.parametrize("extra, error", CLI_CASES)
def test_cli_frontier_writes_and_prints_its_table(tmp_path, extra, error):
    model, tok = sharp_mars(max_positions=2048)
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "out"
    args = ["eval", str(tmp_path / "ckpt"), "--frontier", "--gsm8k", "1", "--humaneval", "1", "--taus", "0.5"]
    args += ["--trees", "2x2", "--typical-trees", "2x2", "--temperature", "0", "--max-new-tokens", "6"]
    args += ["--output", str(out), *extra]
    result = subprocess.run([sys.executable, "-m", "hf_mars.cli", *args], capture_output=True, text=True, timeout=600)
    if error:
        assert result.returncode != 0 and error in result.stderr
        return
    assert result.returncode == 0, result.stderr[-2000:]
    table = (out / "frontier.md").read_text().strip()
    files = ["lossless_2x2.json", "tau-mode_tau___0.5.json", "tau-mode_tau___1.json", "typical_2x2.json"]
    if extra:  # --only tau=0.5
        files = files[1:3]
    assert table in result.stdout and len(rows_of(table)[1]) == len(files)
    assert sorted(p.name for p in (out / "settings").iterdir()) == files
