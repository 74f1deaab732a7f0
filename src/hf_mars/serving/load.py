"""τ as the server's load knob: the τ that rows allowing a range decode with, chosen before every pass.

A request that sends `"mars_tau": [lo, hi]` (or gets the server's `--tau-range`) accepts any τ in that range. τ enters
only the acceptance test, so it may change between any two passes of rows already decoding: the server trades a little
quality for speed while it is busy, without reloading anything (the paper's serving claim). `TauPolicy` chooses it from

- the load: `pressure`, how full the batch and its queue are, in quarters: 0 with one row and nothing waiting, 1 once
  the rows fill the batch or requests wait. τ goes from `hi` at 0 to `lo` at 1, so one client on an idle server runs
  at its highest τ (no quality given up when nothing waits);
- the measured pass costs: where τ = 1 feeds no masks (the dynamic cache), τ < 1 makes every pass B tokens wide. That
  pays only where the tokens a row takes per pass at that τ beat what the wide pass costs over a one-token pass at the
  batch size running (the machine's cost table, `decoding/costs.py`, with its margin); where they do not, τ stays at
  `hi`. Tokens per pass are measured per τ as the rows decode (recent passes count most); a τ not run yet, or not
  for a long while, is assumed to keep each mask with probability 1 - τ, optimistically, so that it is tried and then
  judged by what it did.

A range never widens: the chosen τ is always in [lo, hi], and a request that sends one τ is never changed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ..decoding.costs import MARGIN

LEVELS = 4  # pressure is counted in quarters: at most five τ per range, each measured as it runs
DECAY = 0.98  # per pass, of the tokens-per-pass record of each τ (recent passes count most)
RETRY_COSTS_S = 10.0  # how long a batch size whose costs are not measured yet is taken as unmeasured


def check_tau_range(value) -> tuple[float, float]:
    """`"mars_tau": [lo, hi]`, checked: two numbers with 0 <= lo <= hi <= 1."""
    ok = isinstance(value, (list, tuple)) and len(value) == 2
    ok = ok and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
    if not ok or not 0.0 <= value[0] <= value[1] <= 1.0:
        raise ValueError(
            f"mars_tau must be a number in [0, 1] or a range [lo, hi] with 0 <= lo <= hi <= 1 (the server chooses τ "
            f"in it from its load), got {value!r}"
        )
    return float(value[0]), float(value[1])


@dataclass(frozen=True)
class Choice:
    """The τ of the next pass and why."""

    tau: float
    pressure: float
    why: str


class TauPolicy:
    """Chooses τ within a range before every pass, from the load and the measured pass costs (see the module).

    `costs(rows)`: `(one-token pass, B-token pass)` seconds at that batch size, or None where not measured yet.
    `widens`: whether τ < 1 makes a pass wider than τ = 1 does (False on a static cache, whose every pass is B wide:
    there a lower τ only takes more tokens from the same pass).
    """

    def __init__(self, block_size: int, capacity: int, costs=None, widens: bool = True):
        self.block_size, self.capacity, self.widens = block_size, capacity, widens
        self._costs, self._known, self._tokens = costs, {}, {}  # cost memo by batch size; τ -> [tokens, row passes]

    def pressure(self, rows: int, waiting: int) -> float:
        """How loaded the server is, 0 to 1 in quarters: rows beyond the first, and waiting requests, over the rest
        of the batch."""
        if waiting:
            return 1.0
        share = (rows - 1) / (self.capacity - 1) if self.capacity > 1 else 0.0
        return min(1.0, max(0.0, round(share * LEVELS) / LEVELS))

    def choose(self, lo: float, hi: float, rows: int, waiting: int) -> Choice:
        """The τ in [lo, hi] for the next pass of `rows` rows with `waiting` requests queued."""
        pressure = self.pressure(rows, waiting)
        if pressure == 0 or lo == hi:
            return Choice(hi, pressure, "nothing waits: the highest τ allowed" if pressure == 0 else "one τ allowed")
        tau = min(hi, max(lo, round(hi - pressure * (hi - lo), 4)))  # rounded, for the record of each τ
        if not self.widens or hi < 1.0:
            return Choice(tau, pressure, f"load {pressure:.2f}: every pass is as wide at any τ of the range")
        pays, why = self._pays(rows, tau)
        return Choice(tau if pays else hi, pressure, f"load {pressure:.2f}: {why}")

    def observed(self, tau: float, rows: int, tokens: int) -> None:
        """A pass at `tau` gave `rows` rows `tokens` tokens in all."""
        if rows <= 0:
            return
        for record in self._tokens.values():
            record[0] *= DECAY
            record[1] *= DECAY
        record = self._tokens.setdefault(tau, [0.0, 0.0])
        record[0] += tokens
        record[1] += rows

    def tokens_per_pass(self, tau: float) -> tuple[float, bool]:
        """`(tokens a row takes per pass at tau, whether measured)`."""
        record = self._tokens.get(tau)
        if record and record[1] >= 1:
            return record[0] / record[1], True
        return 1 + (self.block_size - 1) * (1 - tau), False

    def _pays(self, rows: int, tau: float) -> tuple[bool, str]:
        costs = self._costs_at(rows)
        if costs is None:
            return True, f"pass costs not measured at {rows} rows, τ = {tau:g} by load alone"
        one, wide = costs
        earns, measured = self.tokens_per_pass(tau)
        need = MARGIN * wide / one
        pays = earns >= need
        return pays, (
            f"at {rows} rows a {self.block_size}-token pass costs {wide / one:.2f}x a one-token pass; "
            f"τ = {tau:g} takes {earns:.2f} tokens a pass ({'measured' if measured else 'not run yet'}), "
            + (f"so τ = {tau:g}" if pays else f"short of {need:.2f}: the highest τ")
        )

    def _costs_at(self, rows: int):
        if self._costs is None:
            return None
        known = self._known.get(rows)
        if known is None or (known[1] is None and time.monotonic() - known[0] > RETRY_COSTS_S):
            known = self._known[rows] = (time.monotonic(), self._costs(rows))
        return known[1]
