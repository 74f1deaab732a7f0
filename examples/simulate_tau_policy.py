"""What `hf-mars serve`'s τ policy (serving/load.py) would choose on other machines, from their measured pass costs.

Reads pass costs by batch size and tokens per forward by τ (a JSON file, default docs/data/gpu_pass_costs.json,
figures copied from docs/benchmarks.md) and prints, for each machine and load, the τ the policy chooses in the range,
why, and the tokens/s that τ would give against MARS at τ = 1 and plain decoding on the same machine. The policy is
fed the tokens per forward of each τ as if it had measured them. Only batch sizes with measured costs are shown.

    python examples/simulate_tau_policy.py --tau-range 0.8 1 --capacity 8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_mars.serving.load import TauPolicy
from hf_mars.tools.measure.tables import markdown_table

DATA = Path(__file__).resolve().parents[1] / "docs" / "data" / "gpu_pass_costs.json"


def tokens_at(by_tau: dict[float, float], tau: float) -> float:
    """Tokens per forward at `tau`, linear between the measured τ."""
    points = sorted(by_tau.items())
    for (t0, k0), (t1, k1) in zip(points, points[1:]):
        if t0 <= tau <= t1:
            return k0 + (k1 - k0) * (tau - t0) / (t1 - t0)
    return points[0][1] if tau < points[0][0] else points[-1][1]


def simulate(machine: dict, by_tau: dict, lo: float, hi: float, capacity: int, block_size: int = 4) -> list[list]:
    costs = {int(rows): c for rows, c in machine["costs"].items()}
    policy = TauPolicy(block_size, capacity, lambda rows: (costs[rows]["one"], costs[rows]["wide"]), machine["widens"])
    for level in range(5):  # what each τ the policy may choose takes, as if measured
        tau = min(hi, max(lo, round(hi - level / 4 * (hi - lo), 4)))
        policy.observed(tau, 1, tokens_at(by_tau, tau))
    table = []
    for rows in sorted(costs):
        for waiting in (0, rows):
            choice = policy.choose(lo, hi, rows, waiting)
            wide = choice.tau < 1 or not machine["widens"]
            seconds = costs[rows]["wide" if wide else "one"]
            rate = rows * tokens_at(by_tau, choice.tau) / seconds
            at_one = rows / (costs[rows]["wide"] if not machine["widens"] else costs[rows]["one"])
            plain = rows / costs[rows]["plain"]
            ratios = [f"{rate / at_one:.2f}x", f"{rate / plain:.2f}x"]
            table.append([str(rows), str(waiting), f"{choice.tau:g}", f"{rate:.0f}", *ratios, choice.why])
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--tau-range", type=float, nargs=2, default=[0.8, 1.0], metavar=("LO", "HI"))
    parser.add_argument("--capacity", type=int, default=8, help="the server's --max-batch-size (default 8)")
    args = parser.parse_args()
    data = json.loads(args.data.read_text())
    by_tau = {float(t): k for t, k in data["tokens_per_forward"]["by_tau"].items()}
    head = ["rows", "waiting", "τ chosen", "tok/s", "vs MARS τ = 1", "vs plain", "why"]
    for name, machine in data["machines"].items():
        print(f"\n{name}, τ in [{args.tau_range[0]:g}, {args.tau_range[1]:g}], capacity {args.capacity}:\n")
        print(markdown_table(head, simulate(machine, by_tau, *args.tau_range, args.capacity)))


if __name__ == "__main__":
    main()
