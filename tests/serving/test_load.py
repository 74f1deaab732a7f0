"""The server's τ policy (serving/load.py): always inside the request's range, its highest τ when nothing waits, lower
only as the load grows and where the measured pass costs say the wider pass pays."""

from __future__ import annotations

import itertools
import random

import pytest

from hf_mars.decoding.costs import MARGIN
from hf_mars.serving.load import TauPolicy, check_tau_range


def test_the_choice_never_leaves_the_range_at_any_load():
    rng = random.Random(0)
    cost_tables = [None, lambda rows: (1.0, 1.0 + 0.1 * rows), lambda rows: (1.0, 4.0)]
    for costs, widens, capacity in itertools.product(cost_tables, (True, False), (1, 2, 8, 16)):
        policy = TauPolicy(4, capacity, costs, widens=widens)
        for _ in range(200):
            lo = rng.choice([0.0, rng.random(), 0.9, 1.0])
            hi = rng.choice([lo, rng.uniform(lo, 1.0), 1.0])
            rows, waiting = rng.randint(1, capacity), rng.choice([0, 0, rng.randint(1, 40)])
            choice = policy.choose(lo, hi, rows, waiting)
            assert lo <= choice.tau <= hi, (lo, hi, rows, waiting, choice)
            policy.observed(choice.tau, rows, rng.randint(rows, 4 * rows))


@pytest.mark.parametrize("widens", [True, False])
def test_one_request_on_an_idle_server_keeps_its_highest_tau(widens):
    policy = TauPolicy(4, 16, lambda rows: (1.0, 1.0), widens=widens)
    choice = policy.choose(0.5, 1.0, rows=1, waiting=0)
    assert (choice.tau, choice.pressure) == (1.0, 0.0) and "nothing waits" in choice.why


def test_tau_falls_with_the_load_in_quarters_and_reaches_lo_when_requests_wait():
    policy = TauPolicy(4, 9, lambda rows: (1.0, 1.0), widens=True)  # masks free: the load alone decides
    taus = [policy.choose(0.6, 1.0, rows, 0).tau for rows in range(1, 10)]
    assert taus == sorted(taus, reverse=True) and taus[0] == 1.0 and taus[-1] == pytest.approx(0.6)
    assert {round(t, 6) for t in taus} == {1.0, 0.9, 0.8, 0.7, 0.6}  # five levels, each reached
    assert policy.choose(0.6, 1.0, rows=1, waiting=3).tau == pytest.approx(0.6)  # a queue is full load


def test_where_the_wide_pass_costs_more_than_the_tokens_it_takes_tau_stays_at_the_top():
    """A 4-token pass costing 1.5x a one-token pass needs MARGIN x 1.5 tokens a pass; the prior (1 + 3 (1 - τ))
    promises that at τ = 0.6 but not at τ = 0.9, and a τ that ran is judged by what it took."""
    policy = TauPolicy(4, 5, lambda rows: (1.0, 1.5), widens=True)
    need = MARGIN * 1.5
    assert policy.choose(0.9, 1.0, rows=5, waiting=0).tau == 1.0  # prior 1.3 < need
    assert 1 + 3 * 0.4 >= need
    assert policy.choose(0.6, 1.0, rows=5, waiting=0).tau == pytest.approx(0.6)
    for _ in range(20):  # at τ = 0.6 the rows took 1.2 tokens a pass: not enough
        policy.observed(0.6, 5, 6)
    tokens, measured = policy.tokens_per_pass(0.6)
    assert measured and tokens == pytest.approx(1.2)
    choice = policy.choose(0.6, 1.0, rows=5, waiting=0)
    assert choice.tau == 1.0 and "measured" in choice.why and "short of" in choice.why


def test_a_static_cache_or_a_range_below_one_needs_no_cost_to_lower_tau():
    """Every pass is as wide at any τ of the range there, so a lower τ only takes more tokens from it."""
    never = TauPolicy(4, 5, lambda rows: (1.0, 100.0), widens=True)
    assert never.choose(0.5, 1.0, rows=5, waiting=0).tau == 1.0
    assert never.choose(0.5, 0.9, rows=5, waiting=0).tau == pytest.approx(0.5)
    static = TauPolicy(4, 5, None, widens=False)
    assert static.choose(0.5, 1.0, rows=5, waiting=0).tau == pytest.approx(0.5)


def test_unmeasured_costs_leave_the_load_to_decide_and_say_so():
    policy = TauPolicy(4, 5, lambda rows: None, widens=True)
    choice = policy.choose(0.5, 1.0, rows=5, waiting=0)
    assert choice.tau == pytest.approx(0.5) and "not measured" in choice.why


@pytest.mark.parametrize(
    "value", [[0.9], [1.0, 0.5], [0.5, 1.5], [-0.1, 0.5], ["0.5", 1.0], [True, 1.0], [0.5, float("nan")], "0.5,1"]
)
def test_malformed_ranges_are_refused_by_name(value):
    with pytest.raises(ValueError, match=r"mars_tau must be a number in \[0, 1\] or a range"):
        check_tau_range(value)


def test_a_range_is_two_numbers_in_order():
    assert check_tau_range([0.8, 1]) == (0.8, 1.0) and check_tau_range((0, 0)) == (0.0, 0.0)
