"""Where a MARS decoding pass spends its time: the forward and each phase of the graph pass around it.

    python examples/profile_decoding.py [MODEL] [--tau 0.9] [--batch-size 1] [--verify] [--max-new-tokens 128]
                                         [--ops 12]

Wraps the phases of the graph pass (`hf_mars/decoding/graph.py`, which runs every pass after a prompt's) with timers
(nothing is changed in how they run) and times the model's forward with hooks; "host and other" is what remains of
the wall-clock time: the runner's Python between passes, the prompt's pass's own phases and `generate()`'s set-up.
A second run counts the aten ops each part dispatches (outside the forward's: what a GPU's host launches, op by op,
where the pass is not captured), per pass.
Default model: the shipped checkpoint; prompts:
the held-out GSM8K/HumanEval mix of `hf-mars bench`. `--ops N` then decodes the first batch again under
`torch.profiler` and prints the N operators that take the most time, which splits the forward itself (matrix
multiplies, attention, copies and casts, ...).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_mars.decoding import graph, graph_state
from hf_mars.tools.checkpoints.loading import load_checkpoint
from hf_mars.tools.evaluate.evals import load_prompts

# The phases of a graph pass (`hf_mars.decoding.graph.graph_pass`), timed apart from the model's forward
GROUPS = {
    "inputs (masks, rows, reach)": [(graph, "_slot_attention"), (graph_state.GraphPass, "feed_held")],
    "accept (choice, verification)": [(graph, "_scored"), (graph, "_accept")],
    "commit (write, stop)": [(graph, "_commit")],
    "propose (next inputs, drafts)": [(graph, "_next_inputs")],
    "compact (holes out)": [(graph_state.GraphPass, "compact")],
}


def timed(owner, name, totals, group):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[group] += time.perf_counter() - start

    setattr(owner, name, wrapper)
    return lambda: setattr(owner, name, original)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?")
    parser.add_argument("--tau", type=float, default=0.9)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8, help="number of held-out prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--verify", action="store_true", help="lossless mode")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--ops", type=int, default=0, help="also print the N costliest operators (torch.profiler)")
    args = parser.parse_args()

    model, tok = load_checkpoint(args.model, dtype=args.dtype)
    tok.padding_side = "left"
    prompts = [p["text"] for p in load_prompts("heldout", tok, limit=args.prompts)]
    batches = [prompts[i : i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    encode = lambda batch: tok(batch, return_tensors="pt", padding=True, add_special_tokens=False)  # noqa: E731
    model.generate(**encode(batches[0]), max_new_tokens=8, mars_tau=args.tau, mars_verify=args.verify)  # warm-up
    totals, wall, (passes, row_passes, tokens) = timed_runs(model, [encode(b) for b in batches], args)
    ops, ops_passes = counted_run(model, encode(batches[0]), args)
    mode = "lossless" if args.verify else "MARS"
    print(
        f"{mode} τ={args.tau}, batch {args.batch_size}: {passes} passes, {tokens} tokens, "
        f"{tokens / row_passes:.2f} tokens/forward, {1000 * wall / passes:.2f} ms per pass "
        f"({torch.get_num_threads()} threads, {args.dtype})"
    )
    for part in ("forward", *GROUPS, "host and other"):
        count, ms, share = ops[part] / ops_passes, 1000 * totals[part] / passes, 100 * totals[part] / wall
        print(f"  {part:<30} {count:6.1f} ops/pass {ms:7.2f} ms/pass  {share:5.1f}%")
    if args.ops:  # a separate run: the profiler's own overhead stays out of the figures above
        print_ops(model, encode(batches[0]), args)


def timed_runs(model, batches: list, args):
    """Every batch decoded with each group of functions (and the forward) timed: `(seconds by part, wall seconds,
    (passes, passes summed over rows, new tokens))`; what no group holds is "host and other"."""
    totals = defaultdict(float)
    restore = [timed(owner, name, totals, group) for group, items in GROUPS.items() for owner, name in items]
    state = {}

    def forward_done(*_):
        totals["forward"] += time.perf_counter() - state["t"]

    hooks = [
        model.register_forward_pre_hook(lambda *_: state.__setitem__("t", time.perf_counter())),
        model.register_forward_hook(forward_done),
    ]
    passes = row_passes = tokens = 0
    start = time.perf_counter()
    try:
        for inputs in batches:
            out = model.generate(
                **inputs,
                max_new_tokens=args.max_new_tokens,
                mars_tau=args.tau,
                mars_verify=args.verify,
                return_dict_in_generate=True,
            )
            passes += out.mars_stats.forward_passes
            row_passes += int(out.mars_stats.passes_per_row.sum())
            tokens += int(out.mars_stats.new_tokens.sum())
    finally:
        wall = time.perf_counter() - start
        for undo in restore:
            undo()
        for hook in hooks:
            hook.remove()
    totals["host and other"] = wall - sum(totals.values())
    return totals, wall, (passes, row_passes, tokens)


class PhaseOps(TorchDispatchMode):
    """Counts the aten ops dispatched in each part: the innermost group of functions running, "forward" inside the
    model's, else "host and other"."""

    def __init__(self):
        super().__init__()
        self.counts, self.parts = defaultdict(int), ["host and other"]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.parts[-1]] += 1
        return func(*args, **(kwargs or {}))

    def within(self, owner, name, part):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            self.parts.append(part)
            try:
                return original(*args, **kwargs)
            finally:
                self.parts.pop()

        setattr(owner, name, wrapper)
        return lambda: setattr(owner, name, original)


def counted_run(model, inputs, args) -> tuple[dict, int]:
    """`(aten ops by part, passes)` of one more run of the first batch."""
    counter = PhaseOps()
    restore = [counter.within(owner, name, group) for group, items in GROUPS.items() for owner, name in items]
    hooks = [
        model.register_forward_pre_hook(lambda *_: counter.parts.append("forward")),
        model.register_forward_hook(lambda *_: counter.parts.remove("forward")),  # None: the output stays
    ]
    try:
        with counter:
            out = model.generate(
                **inputs,
                max_new_tokens=args.max_new_tokens,
                mars_tau=args.tau,
                mars_verify=args.verify,
                return_dict_in_generate=True,
            )
    finally:
        for undo in restore:
            undo()
        for hook in hooks:
            hook.remove()
    return counter.counts, out.mars_stats.forward_passes


def print_ops(model, inputs, args) -> None:
    """The `args.ops` costliest operators of one more run, under `torch.profiler`."""
    from torch.profiler import ProfilerActivity, profile

    cuda = model.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        model.generate(**inputs, max_new_tokens=args.max_new_tokens, mars_tau=args.tau, mars_verify=args.verify)
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.ops))


if __name__ == "__main__":
    main()
