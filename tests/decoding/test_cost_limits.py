"""How much timing the first use of `mars_lossless="auto"` costs: batch sizes share their power of two's pass costs,
and widths that no tree could pay for are not timed (`costs.cost_batch`, `pass_costs(limit=...)`)."""

from __future__ import annotations

import json

import pytest
from helpers import make_model, make_tokenizer

import hf_mars
from hf_mars.decoding.costs import choose_tree, cost_batch, machine_key, pay_limit
from hf_mars.tools.measure import passes
from hf_mars.tools.measure.passes import pass_costs


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_MARS_CACHE", str(tmp_path))
    return tmp_path


def slow_width(monkeypatch, per_token: float = 0.001) -> list:
    """A clock where a pass costs `per_token` seconds per token (wide passes are dear, as in an emulated dtype), and
    that stops at the first width past the limit as the real warm-up does; records what was timed."""
    calls = []

    def measure(model, batch_size, widths, limit=None, one=None, **_):
        calls.append((batch_size, tuple(widths)))
        timed = {}
        for width in sorted(widths):
            timed[width] = per_token * width
            one = timed.get(1, one)
            if limit is not None and timed[width] > 1.25 * limit * one:
                break
        return timed

    monkeypatch.setattr(passes, "measure_pass_costs", measure)
    monkeypatch.setattr(passes, "measure_overheads", lambda *a, **k: dict(plain_overhead=0.0, mars_overhead=0.0))
    return calls


def test_batch_sizes_share_their_power_of_two(cache_dir, monkeypatch):
    assert [cost_batch(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 32]
    calls = slow_width(monkeypatch)
    model = make_model("llama")
    assert pass_costs(model, 3, [4]) == pass_costs(model, 4, [4])
    assert [c[0] for c in calls] == [4]  # batch 3 was timed as batch 4, and batch 4 read it
    assert list(json.loads((cache_dir / "pass_costs.json").read_text())) == [machine_key(model, 4)]


def test_widths_past_what_any_tree_can_pay_are_not_timed(cache_dir, monkeypatch):
    calls = slow_width(monkeypatch)
    model = make_model("llama")
    acceptance = {"2x1": 1.5, "2x3+4": 2.2, "4x3+8": 2.6}  # widths 4, 16, 56
    limit = pay_limit(acceptance)  # 2.6 / 1.1: a pass may cost at most about 2.4 one-token passes
    costs = pass_costs(model, 1, [4, 16, 56], limit=limit)
    assert calls == [(1, (1, 4, 16, 56))] and set(costs.forward) == {1, 4, 16, 56}
    assert costs.forward[16] == costs.forward[56] == costs.forward[4]  # untimed: counted at the 4-wide pass's cost
    assert choose_tree(acceptance, costs) is None  # every tree loses, as it would have measured
    saved = json.loads((cache_dir / "pass_costs.json").read_text())[machine_key(model, 1)]
    assert set(saved["forward"]) == {"1", "4"}  # only what was timed is stored as timed
    pass_costs(model, 1, [4, 16, 56], limit=limit)
    assert len(calls) == 1  # the next call times nothing
    pass_costs(model, 1, [16, 56], limit=20.0)  # a checkpoint whose trees could pay for wide passes
    assert calls[-1] == (1, (16, 56))  # what the first run left out is timed now
    assert pass_costs(model, 1, [16, 56]).forward[56] == pytest.approx(0.056)  # no limit: every width timed


def test_real_warm_up_stops_at_the_first_width_past_the_limit(cache_dir):
    model = hf_mars.to_mars(make_model("llama"), make_tokenizer(), block_size=2)
    measured = passes.measure_pass_costs(model, 1, [1, 4, 8, 16], context=16, repeats=1, limit=1e-3)
    assert set(measured) == {1, 4}  # 4 tokens cost more than a thousandth of one: 8 and 16 are left out
    assert set(passes.measure_pass_costs(model, 1, [1, 4, 8], context=16, repeats=1)) == {1, 4, 8}
