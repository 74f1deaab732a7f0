"""`hf-mars tune`: time lossless draft trees against plain `generate()` on this machine and keep the fastest; measure
the masks' per-depth accuracy and propose per-depth trees to time next."""

from __future__ import annotations

from pathlib import Path

from ..tools.measure.trees import TUNE_TREES
from .bench import load_on_device
from .options import DTYPES, add_attention, add_model, draft_tree

HELP = "find the fastest lossless draft tree on this machine"
DESCRIPTION = "Measure lossless draft trees against plain generate() and pick the fastest."


def add_parser(subparsers) -> None:
    tune = subparsers.add_parser("tune", help=HELP, description=DESCRIPTION)
    add_model(tune)
    tune.add_argument(
        "--prompts",
        default="tuning",
        help="JSONL file, or `tuning` (default: GSM8K test's last problems and Python function stubs, evaluated "
        "nowhere, so that bench's `heldout` figures are not tuned to), `heldout` or `toy` (see bench)",
    )
    tune.add_argument("--limit", type=int, default=8, help="use the first N prompts (default 8)")
    tune.add_argument(
        "--trees",
        type=draft_tree,
        nargs="+",
        metavar="BxN[+L]",
        default=list(TUNE_TREES),
        help="draft trees to try: block size B, N candidates for the first draft or counts per draft depth "
        "(4x3,2,2), L prompt-lookup tokens (default: "
        + " ".join(f"{b}x{n}+{lookup}" for b, n, lookup in TUNE_TREES)
        + "); tune also prints per-depth trees worth trying",
    )
    tune.add_argument("--taus", type=float, nargs="+", default=[0.0], help="τ values to try (default 0: every draft)")
    tune.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="batch size to tune for; --save keeps other batch sizes' trees (a batch uses the entry of "
        "the largest size it reaches)",
    )
    tune.add_argument("--max-new-tokens", type=int, default=96, help="most tokens to generate per prompt")
    tune.add_argument("--repeats", type=int, default=1, help="timed repeats; the median is reported")
    _add_output_options(tune)
    tune.set_defaults(run=run)


def _add_output_options(tune) -> None:
    """What tune writes (`--save`, `--auto`), and how it loads and runs the model."""
    tune.add_argument(
        "--save",
        action="store_true",
        help="write each tree's tokens per forward into the checkpoint's generation_config.json (mars_acceptance) "
        "and the fastest tree here as its mars_lossless for --batch-size",
    )
    tune.add_argument(
        "--auto",
        action="store_true",
        help='with --save: set mars_lossless="auto" instead, so that every machine picks its tree from '
        "mars_acceptance and its own pass costs (for a checkpoint others will run)",
    )
    tune.add_argument(
        "--refresh-costs",
        action="store_true",
        help="measure this machine's pass costs again (they are cached per device, dtype, batch and model shape)",
    )
    tune.add_argument("--revision", help="pin a Hub revision: remote code runs on your machine")
    tune.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="tune in the dtype you decode in: the fastest tree depends on it",
    )
    add_attention(tune)
    tune.add_argument("--device", help="e.g. cuda (default: where the model loads)")
    tune.add_argument(
        "--compile",
        action="store_true",
        help="tune on the path a GPU server runs: a static cache and generate()'s torch.compile path (every tree "
        'compiles once, untimed), and report the costs of compiled passes, which mars_lossless="auto" reads there',
    )


def run(args) -> None:
    from ..tools.evaluate.evals import load_prompts
    from ..tools.measure.tuning import acceptance, save_acceptance, save_lossless_preset, tune_lossless

    if args.auto and not args.save:
        raise SystemExit("--auto says what --save writes: pass both.")
    if args.save and args.model is not None and not Path(args.model).is_dir():  # say so before minutes of measuring
        raise SystemExit(f"--save writes into a local checkpoint folder; {args.model} is not one.")
    model, tokenizer = load_on_device(args)
    prompts = load_prompts(args.prompts, tokenizer, limit=args.limit)
    best, fastest, cells = tune_lossless(
        model,
        tokenizer,
        prompts,
        trees=args.trees,
        taus=args.taus,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        compiled=args.compile,
    )
    measured = acceptance(cells, args.trees, args.taus[0])
    _report(model, args, len(prompts), cells, best, fastest)
    _report_costs(model, args, cells, measured)
    _propose(model, tokenizer, prompts, args)
    if args.save:
        folder = Path(args.model) if args.model is not None else _shipped()
        written = save_acceptance(folder, measured, auto=args.auto)
        print(f"Saved mars_acceptance (tokens per forward of {len(measured)} trees) to {written}.")
        if args.auto:
            print('mars_lossless = "auto": generate(mars_verify=True) picks the tree from them on each machine.')
        else:
            written = save_lossless_preset(folder, best, args.batch_size)
            print(f"Saved to {written} for batch size {args.batch_size} and up: generate(mars_verify=True) uses it.")


def _report(model, args, n_prompts: int, cells, best: dict, fastest) -> None:
    import torch

    from ..tools.measure.bench import format_table

    device = model.device.type if model.device.type != "cpu" else f"cpu, {torch.get_num_threads()} threads"
    path = "static cache, compiled" if args.compile else "default cache (MARS: the runner's static one), eager"
    print(f"\nLossless draft trees on {device}, {args.dtype}, {path}, batch {args.batch_size}, {n_prompts} prompts:\n")
    print(format_table(cells))
    ar = next(c for c in cells if c.method == "ar")
    print(
        f"\nFastest: {fastest.method}, {fastest.speedup:.2f}x plain generate() ({ar.tokens_per_second:.1f} tokens/s)"
        f" -> mars_lossless = {best}"
    )
    if fastest.speedup < 1.0:
        print("No draft tree beat plain generate() here: passes over several tokens cost too much on this machine.")


def _shipped() -> Path:
    from ..tools.checkpoints.shipped import default_checkpoint

    return default_checkpoint()


def _report_costs(model, args, cells, measured: dict[str, float]) -> None:
    """What `mars_lossless="auto"` would pick here from the measured tokens per forward and this machine's pass
    costs, each tree's predicted speed-up beside the one just measured: the cost model checked against the clock."""
    from ..decoding.costs import choose_tree, parse_tree, pass_width, tree_key

    costs = _costs(model, args, [parse_tree(name) for name in measured])
    by_method = {cell.method: cell for cell in cells}
    if args.compile:
        what = f"a compiled plain step {costs.forward[1] * 1e3:.2f} ms; a tree's width: its whole pass as one graph"
    else:
        what = (
            f"a one-token forward {costs.forward[1] * 1e3:.1f} ms, plus {costs.plain_overhead * 1e3:.1f} ms a plain "
            f"step, {costs.mars_overhead * 1e3:.1f} ms a lossless pass"
        )
    print(f"\nPass costs here (batch {args.batch_size}: {what}) and the speed-ups they predict:\n")
    print("| tree | pass width | tokens/forward | pass vs width 1 | predicted | measured |")
    print("|---|---|---|---|---|---|")
    for name, tokens in measured.items():
        tree, cell = parse_tree(name), by_method[f"lossless {tree_key(*parse_tree(name))} tau={args.taus[0]}"]
        width, predicted = pass_width(*tree), costs.tree_rate(tree, tokens) / costs.plain_rate()
        ratio = costs.forward[width] / costs.forward[1]
        print(f"| {name} | {width} | {tokens:.2f} | {ratio:.2f}x | {predicted:.2f}x | {cell.speedup:.2f}x |")
    choice = choose_tree(measured, costs)
    picked = tree_key(*choice) if choice else "none (plain decoding: no tree beats it by the margin here)"
    print(f'\nmars_lossless="auto" would run: {picked}')


def _costs(model, args, trees):
    """This machine's pass costs for `trees`, of the path tune timed them on: eager forwards, or compiled passes."""
    from ..decoding.costs import pass_width
    from ..decoding.settings import compiles
    from ..tools.measure.passes import PassTimer, compiled_pass_costs, pass_costs
    from ..tools.measure.tuning import compiled_call

    if not args.compile:  # asked for by a person: timed busy or not (a busy timing says so), overheads too
        widths, timer = [pass_width(*tree) for tree in trees], PassTimer(overheads=True, busy_ok=True)
        return pass_costs(model, args.batch_size, widths, args.refresh_costs, timer=timer)
    call = compiled_call(model, args.max_new_tokens, args.batch_size, trees)
    config = compiles(model, [model.generation_config], call)
    return compiled_pass_costs(model, args.batch_size, trees, config, refresh=args.refresh_costs)


def _propose(model, tokenizer, prompts, args) -> None:
    """The masks' per-depth top-k accuracy along the greedy outputs of the prompts, and the per-depth trees it
    favours at each pass width up to the widest of --trees (expected tokens per forward, lookup aside), to time next
    with --trees."""
    from ..decoding.costs import pass_width, tree_key
    from ..tools.measure.tuning import chain_accuracy, depth_accuracy, depth_ranks, propose_trees

    ranks = depth_ranks(model, tokenizer, prompts, args.max_new_tokens)
    if not len(ranks):
        print("\nThe outputs are too short to measure per-depth accuracy.")
        return
    shown = (1, 2, 3, 5, 8)
    print(f"\nHow often the true next token is among mask d's top k ({len(ranks)} positions of greedy outputs):\n")
    print("| depth | " + " | ".join(f"top-{k}" for k in shown) + " |")
    print("|---|" + "---|" * len(shown))
    for depth, row in enumerate(depth_accuracy(ranks), start=1):
        print(f"| {depth} | " + " | ".join(f"{row[k - 1]:.0%}" for k in shown) + " |")
    widest = max(pass_width(*tree) for tree in args.trees)
    frontier = propose_trees(chain_accuracy(ranks), widest)
    print(f"\nPer-depth trees with the most expected tokens per forward, by pass width up to {widest}:\n")
    print("| pass width | tree | expected tokens/forward |")
    print("|---|---|---|")
    for width, tree, tokens in frontier:
        print(f"| {width} | {tree_key(*tree)} | {tokens:.2f} |")
    step = -(-len(frontier) // 6)  # about six trees, from the narrowest to the widest
    picks = frontier[::step] + ([frontier[-1]] if (len(frontier) - 1) % step else [])
    print("\nTime some here: hf-mars tune --trees " + " ".join(tree_key(*tree) for _, tree, _ in picks))
