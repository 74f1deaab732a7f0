"""`hf-mars bench`: MARS against plain AR and prompt-lookup decoding on one model, side by side."""

from __future__ import annotations

from pathlib import Path

from .options import (
    add_decoding,
    add_machine,
    add_model,
    add_tau_range,
    decoding_kwargs,
    describe_decoding,
    draft_tree,
    mask_cost,
)

TAUS = [1.0, 0.95, 0.9, 0.8, 0.7]  # τ-mode's default sweep (lossless mode adds its own default, 0)
HELP = "MARS vs plain AR and prompt lookup: tokens/forward, speed"
DESCRIPTION = "MARS vs plain AR and prompt-lookup decoding: tokens/forward, speed, agreement."


def sweep(taus) -> dict:
    """`run_benchmark`'s τs for `--taus`: those asked for, for both modes; by default τ-mode's sweep, and lossless
    mode at it and at its own default (τ = 0, what `mars_verify=True` alone runs at), which the sweep leaves out."""
    return dict(taus=taus, lossless_taus=taus) if taus else dict(taus=TAUS, lossless_taus=[*TAUS, 0.0])


def add_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help=HELP, description=DESCRIPTION)
    add_model(bench)
    bench.add_argument(
        "--prompts",
        default="heldout",
        help="JSONL file (prompt or messages, optional answer), or `heldout` (GSM8K + HumanEval, default), `tuning` "
        "(what tune measures on) or `toy`",
    )
    bench.add_argument("--limit", type=int, default=32, help="use the first N prompts (default 32)")
    bench.add_argument(
        "--skip", type=int, default=0, help="start after the first N prompts (e.g. those `tune` measured trees on)"
    )
    bench.add_argument(
        "--taus",
        type=float,
        nargs="+",
        default=None,
        help=f"τ values to run (default: {' '.join(map(str, TAUS))}; lossless mode at its own default, 0, too)",
    )
    bench.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16], help="batch sizes to run")
    bench.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate per prompt")
    bench.add_argument("--repeats", type=int, default=3, help="timed repeats; the median is reported")
    bench.add_argument(
        "--prompt-lookup", type=int, default=10, help="prompt_lookup_num_tokens of the peer (0: skip it)"
    )
    bench.add_argument("--no-lossless", action="store_true", help="skip the lossless (mars_verify) runs")
    bench.add_argument(
        "--no-tau-mode",
        action="store_true",
        help="skip the τ-mode runs (e.g. --taus 0 for lossless mode's default τ alone)",
    )
    bench.add_argument(
        "--mask-costs",
        type=mask_cost,
        nargs="+",
        default=[0.0, "auto"],
        help="values of mars_mask_cost to measure: 0 (B-1 masks every pass), a cost per mask, or "
        "`auto` (measured at each batch size); default: 0 auto",
    )
    bench.add_argument(
        "--lossless-trees",
        type=draft_tree,
        nargs="+",
        default=[],
        metavar="BxN[+L]",
        help="also measure lossless mode with mars_block_size=B, mars_draft_candidates=N and "
        "mars_lookup=L, e.g. 2x3 or 2x3+4",
    )
    add_decoding(
        bench,
        "sample plain decoding and MARS at this temperature (the model's other sampling settings, e.g. top-k, "
        "as its generation config has them), every run from the same seed; default: greedy. Prompt lookup is "
        "then left out",
    )
    _add_other_benches(bench)
    add_machine(bench)
    bench.add_argument("--output", default="outputs/bench", help="folder for bench.json and bench.png")
    bench.set_defaults(run=run)


def _add_other_benches(bench) -> None:
    """The benches that run instead of the decoding table: host-bound passes, compiled decoding, the server."""
    bench.add_argument(
        "--host-bound",
        action="store_true",
        help="instead: ms per MARS pass against ms per plain step on a thin deep random model on one CPU thread, "
        "a proxy for a small model on a GPU (uses --batch-sizes, --max-new-tokens, --repeats, --compile)",
    )
    bench.add_argument(
        "--compile",
        action="store_true",
        help="plain generate() and MARS with a static cache and generate()'s torch.compile path, as a GPU server "
        "runs a small model (prompt lookup stays eager); the first run of each method compiles and is not timed",
    )
    bench.add_argument(
        "--serve",
        action="store_true",
        help="instead: `hf-mars serve` on loopback under --clients concurrent streaming clients, MARS lossless "
        "against plain decoding in interleaved rounds (uses --max-new-tokens, --repeats as rounds, --dtype, --device)",
    )
    bench.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16], help="with --serve (default: 1 4 16)")
    add_tau_range(
        bench,
        "with --serve: the τ policy's load ramp instead, plain against MARS at τ = 1 and MARS with τ chosen from the "
        "load in [LO, HI], with the τ it chose and its answers' agreement with τ = 1's (e.g. --clients 1 4 16 32)",
    )
    bench.add_argument(
        "--logprobs",
        type=int,
        metavar="K",
        help="with --serve: each mode also with every request asking its tokens' log probabilities and the K "
        "likeliest alternatives (chat's logprobs and top_logprobs), side by side: what recording them costs",
    )
    bench.add_argument("--max-batch-size", type=int, default=16, help="with --serve: the server's (default 16)")
    bench.add_argument(
        "--cache-slots",
        type=int,
        help="with --serve: the server's static cache slots per row (as `serve --cache-slots`; with --compile, the "
        "pass compiled)",
    )
    bench.add_argument(
        "--structured",
        action="store_true",
        help="instead: JSON under four schemas (32 prompts), plain constrained greedy against lossless mode and "
        "τ = 0.9 under the same grammar: validity, equality with plain, tokens/pass, tokens/s, the grammar's own "
        "time (uses --batch-sizes, --max-new-tokens, --repeats as rounds, --dtype, --attention)",
    )
    bench.add_argument(
        "--vllm",
        metavar="PYTHON",
        help="instead: vLLM (the Python of its environment, where hf_mars is installed too) decoding the checkpoint "
        "plainly against the checkpoint drafting for itself, K = --draft-tokens, and MARS's own step in vLLM, K = "
        "--step-tokens, then hf_mars plain and lossless "
        "on the same prompts (uses --prompts, --limit, --batch-sizes, --max-new-tokens, --repeats, --dtype)",
    )
    bench.add_argument("--draft-tokens", type=int, nargs="+", default=[2, 3, 4], help="with --vllm (default: 2 3 4)")
    bench.add_argument(
        "--step-tokens", type=int, nargs="*", default=[1, 2, 3], help="with --vllm: MARS step's K (default: 1 2 3)"
    )
    bench.add_argument(
        "--url",
        help="with --serve: drive this already running OpenAI-compatible server (e.g. `transformers serve "
        "--continuous-batching` on a plain copy of the checkpoint) instead, with plain requests",
    )


def run_host_bound(args) -> None:
    import torch

    from ..tools.measure.hostbound import (
        DECODINGS,
        format_host_ops,
        format_pass_costs,
        forward_costs,
        host_bound_model,
        host_ops,
        pass_costs,
    )

    torch.set_num_threads(1)
    model, tokenizer = host_bound_model()
    rows = pass_costs(model, tokenizer, args.batch_sizes, args.max_new_tokens, args.repeats, args.compile)
    layers, width = model.config.num_hidden_layers, model.config.hidden_size
    how = "static cache, compiled" if args.compile else "default cache (MARS: the runner's static one), eager"
    print(f"\nhost-bound proxy: random Llama, {layers} layers, hidden {width}, float32, 1 CPU thread, {how}\n")
    print(format_pass_costs(rows))
    print("\naten ops dispatched outside the model's forward (eager; the prompt's pass included; static cache, then")
    print("greedy as the default call, no cache argument: the eager runner); 'one more pass': what each further pass")
    print("adds, a run's set-up cancelled out (the run against one of half its new tokens):\n")
    ops = host_ops(model, tokenizer, args.batch_sizes, args.max_new_tokens, tuple(DECODINGS), default=("greedy",))
    print(format_host_ops(ops))
    if not args.compile:
        print("\nThe model's forward alone (ms), after 24 cached tokens, as a pass of that width feeds it:")
        for batch in args.batch_sizes:
            costs = forward_costs(model, batch)
            print(
                f"batch {batch}: "
                + ", ".join(f"{w} tokens {ms:.2f} ({ms / costs[1]:.2f}x)" for w, ms in costs.items())
            )


def run_serve(args) -> None:
    import json

    from openai import OpenAI

    from ..tools.checkpoints.loading import resolve_checkpoint
    from ..tools.measure.serve_bench import MODES, ramp_modes, run_serve_bench, serve_plot, serve_table, start_server
    from .serve import cache_slots, check_cache_slots

    if args.tau_range:
        from ..serving.load import check_tau_range

        check_tau_range(args.tau_range)
        if args.url:
            raise SystemExit("--tau-range ramps hf-mars serve's τ policy: it runs the server itself (no --url).")
    if args.url:  # another OpenAI-compatible server, already running: plain requests only
        model = args.model or OpenAI(base_url=args.url, api_key="-").models.list().data[0].id
        rows = run_serve_bench(
            args.url, model, args.clients, max_tokens=args.max_new_tokens, rounds=args.repeats, modes={"plain": {}}
        )
        served = f"the server at {args.url}"
    else:
        if args.dtype == "auto":
            raise SystemExit("--serve runs the server in one dtype: pass --dtype float32 or bfloat16.")
        model = args.model or resolve_checkpoint(None)
        check_cache_slots(args)
        slots = cache_slots(args)
        url, server = start_server(
            model, args.dtype, args.device or "auto", args.max_batch_size, args.compile, slots, args.attention
        )
        modes = ramp_modes(*args.tau_range) if args.tau_range else MODES
        if args.logprobs is not None:
            scored = {"logprobs": True, "top_logprobs": args.logprobs}
            modes = {**modes, **{f"{mode} + logprobs": {**fields, **scored} for mode, fields in modes.items()}}
        try:
            rows = run_serve_bench(
                url, model, args.clients, max_tokens=args.max_new_tokens, rounds=args.repeats, modes=modes
            )
        finally:
            server.should_exit = True
        served = f"hf-mars serve on {device_name(args.device)}, {args.dtype}, {args.attention or 'sdpa'} attention"
        served += f", max batch {args.max_batch_size}"
        if slots:
            served += f", one graph pass over {slots} cache slots" + (", compiled" if args.compile else ", eager")
    print(f"\n{served}, streaming clients:\n")
    print(serve_table(rows))
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_bench.json").write_text(json.dumps({"model": model, "dtype": args.dtype, "rows": rows}, indent=1))
    serve_plot(rows, out / "serve_bench.png")
    print(f"\nWrote {out / 'serve_bench.json'} and {out / 'serve_bench.png'}")


def run_vllm(args) -> None:
    """vLLM's table, then hf_mars's on the same prompts and batch sizes (one machine, one after the other)."""
    from ..tools.checkpoints.loading import resolve_checkpoint
    from ..tools.evaluate.evals import load_prompts
    from ..tools.measure.bench import format_table, run_benchmark
    from ..tools.measure.vllm_bench import format_rows, vllm_table

    if args.dtype == "auto":
        raise SystemExit("--vllm compares one dtype: pass --dtype float32 or bfloat16.")
    model, tokenizer = load_on_device(args)
    prompts = load_prompts(args.prompts, tokenizer, limit=args.skip + args.limit)[args.skip :]
    ids = [tokenizer(row["text"], add_special_tokens=False)["input_ids"] for row in prompts]
    path = resolve_checkpoint(args.model, args.revision)
    rows = vllm_table(
        path,
        ids,
        args.vllm,
        draft_tokens=args.draft_tokens,
        step_tokens=args.step_tokens,
        batch_sizes=args.batch_sizes,
        max_tokens=args.max_new_tokens,
        repeats=args.repeats,
        dtype=args.dtype,
    )
    cells = run_benchmark(
        model,
        tokenizer,
        prompts,
        taus=[1.0],
        batch_sizes=args.batch_sizes,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        prompt_lookup=0,
        mask_costs=[0.0],
    )
    print(f"\n{args.model or 'the shipped checkpoint'}, {args.dtype}, {len(prompts)} prompts, on {device_name(None)}")
    print("\nvLLM (greedy; drafts itself: K drafts from a second forward over [last token, masks]; MARS step:")
    print("K drafts from the masks after the drafts of the verifying forward, its first K acceptance positions):\n")
    print(format_rows(rows))
    print("\nhf_mars on the same prompts:\n")
    print(format_table(cells))
    _save(cells, Path(args.output), {"model": args.model or "shipped", "dtype": args.dtype, "vllm": rows})


def run_structured(args) -> None:
    from ..tools.measure.structured import structured_table

    model, tokenizer = load_on_device(args)
    table = structured_table(model, tokenizer, args.batch_sizes, args.max_new_tokens, args.repeats)
    attention = model.config._attn_implementation
    name = args.model or "the shipped checkpoint"
    print(f"\n{name} on {device_name(model)}, {args.dtype}, {attention}, greedy, 32 prompts asking for JSON\n")
    print(table)


def run(args) -> None:
    from ..tools.evaluate.evals import load_prompts
    from ..tools.measure.bench import format_table, run_benchmark
    from ..tools.measure.calibrate import measure_mask_cost

    if args.host_bound:
        return run_host_bound(args)
    if args.serve:
        return run_serve(args)
    if args.vllm:
        return run_vllm(args)
    if args.structured:
        return run_structured(args)
    decoding = decoding_kwargs(args)
    sampling = decoding.get("do_sample", False)
    model, tokenizer = load_on_device(args)
    prompts = load_prompts(args.prompts, tokenizer, limit=args.skip + args.limit)[args.skip :]
    costs = {b: measure_mask_cost(model, b) for b in args.batch_sizes}  # once: printed, saved, and used by `auto`
    cells = run_benchmark(
        model,
        tokenizer,
        prompts,
        **sweep(args.taus),
        batch_sizes=args.batch_sizes,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        verify=not args.no_lossless,
        tau_mode=not args.no_tau_mode,
        prompt_lookup=0 if sampling else args.prompt_lookup,
        mask_costs=args.mask_costs,
        measured_costs=costs,
        trees=args.lossless_trees,
        compiled=args.compile,
        decoding=decoding,
    )
    device = device_name(model)
    name, attention = args.model or "the shipped checkpoint", model.config._attn_implementation
    how = "static cache, compiled" if args.compile else "default cache (MARS: the runner's static one), eager"
    how += f", {describe_decoding(args)}" if describe_decoding(args) else ""
    how += " (agreement: equal draws)" if sampling else ""
    print(f"\n{name} on {device}, {args.dtype}, {attention}, {how}, {len(prompts)} prompts\n")
    print(format_table(cells))
    print(_lossless_trees(model, args.batch_sizes, args.compile))
    plain = _fastest_plain(model, tokenizer, prompts, args, cells, decoding)
    print(
        "\nmars_mask_cost measured here (what 1, 2, ... masks add to a one-token pass), by batch size: "
        + "; ".join(f"{b}: {c}" for b, c in costs.items())
    )
    meta = dict(
        model=args.model or "shipped",
        device=device,
        dtype=args.dtype,
        prompts=len(prompts),
        max_new_tokens=args.max_new_tokens,
        mask_cost=costs,
        compiled=args.compile,
        temperature=args.temperature,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        fastest_plain=plain,
    )
    _save(cells, Path(args.output), meta)


def load_on_device(args):
    """The checkpoint of `bench`/`tune`, moved to `--device` if given: `(model, tokenizer)`. `--dtype auto` loads it
    in float32, then keeps the dtype `choose_dtype` picks, says why, and sets `args.dtype` to it."""
    from ..tools.checkpoints.loading import load_checkpoint

    auto = args.dtype == "auto"
    model, tokenizer = load_checkpoint(args.model, args.revision, "float32" if auto else args.dtype, args.attention)
    if args.device:
        model.to(args.device)
    if auto:
        from ..tools.measure.dtypes import choose_dtype, in_dtype

        batch = min(getattr(args, "batch_sizes", None) or [getattr(args, "batch_size", 1)])
        choice = choose_dtype(model, batch, new_tokens=args.max_new_tokens)
        print(f"[{choice.reason()}]")
        model, args.dtype = in_dtype(model, choice.dtype), str(choice.dtype).removeprefix("torch.")
    return model, tokenizer


def _lossless_trees(model, batch_sizes, compiled: bool) -> str:
    """Which tree "lossless tau=..." ran at each batch size (the checkpoint's `mars_lossless`: "auto" picks here),
    asked as the runs asked, so that a compiled run reads the compiled pass costs it chose from (timing nothing)."""
    from ..decoding.costs import tree_key
    from ..tools.measure.decode import compiled_path

    trees = []
    for batch in batch_sizes:
        s = model.mars_settings(batch_size=batch, mars_verify=True, **(compiled_path(model) if compiled else {}))
        tree = (s["mars_block_size"], s["mars_draft_candidates"], s["mars_lookup"])
        trees.append(f"batch {batch}: " + (tree_key(*tree) if tree[0] > 1 else "none (plain decoding)"))
    preset = getattr(model.generation_config, "mars_lossless", None)
    source = (
        "auto: from this machine's pass costs" if preset == "auto" else "the checkpoint's preset" if preset else ""
    )
    return f"\nLossless mode's tree ({source or 'the model defaults'}): " + ", ".join(trees)


def _fastest_plain(model, tokenizer, prompts, args, cells, decoding: dict) -> dict:
    """Plain `generate()` in the other dtypes this machine runs (after the main run, same prompts, decoded as it was:
    `decoding`), and every cell against the fastest plain decoding by batch size: `{batch size: [dtype, tokens/s]}`."""
    from ..tools.measure.bench import run_benchmark
    from ..tools.measure.dtypes import candidate_dtypes, in_dtype

    fastest = {c.batch_size: [args.dtype, c.tokens_per_second] for c in cells if c.method == "ar"}
    for dtype in candidate_dtypes(model):
        if dtype == model.dtype or args.compile:
            continue
        other = run_benchmark(
            in_dtype(model, dtype),
            tokenizer,
            prompts,
            taus=(),
            batch_sizes=args.batch_sizes,
            max_new_tokens=args.max_new_tokens,
            repeats=args.repeats,
            verify=False,
            prompt_lookup=0,
            mask_costs=(),
            tau_mode=False,
            decoding=decoding,
        )
        for cell in other:
            if cell.tokens_per_second > fastest[cell.batch_size][1]:
                fastest[cell.batch_size] = [str(dtype).removeprefix("torch."), cell.tokens_per_second]
    print("\nAgainst the fastest plain generate() here, by batch size (plain in other dtypes ran after the table):")
    for batch, (dtype, rate) in fastest.items():
        row = [c for c in cells if c.batch_size == batch]
        exact = [c for c in row if c.method.startswith("lossless")]  # the methods that keep greedy's text
        exact = max(exact, key=lambda c: c.tokens_per_second, default=None)
        best = max(row, key=lambda c: c.tokens_per_second)
        said = f"batch {batch}: plain {dtype} {rate:.1f} tokens/s; "
        if exact is not None:
            said += f"fastest lossless {exact.method} ({args.dtype}) {exact.tokens_per_second / rate:.2f}x it; "
        print(said + f"fastest of all {best.method} ({args.dtype}) {best.tokens_per_second / rate:.2f}x it")
    return fastest


def device_name(where) -> str:
    """ "cuda (<GPU name>)" or "cpu (<N> threads)": what a timing was taken on (`where`: a model, a device, or a
    device name; None: where accelerate would place a model)."""
    import torch

    device = getattr(where, "device", where)
    kind = torch.device(device).type if device else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        return f"cuda ({torch.cuda.get_device_name()})"
    return f"{kind} ({torch.get_num_threads()} threads)"


def _save(cells, out: Path, meta: dict) -> None:
    from ..tools.measure.bench import save

    out.mkdir(parents=True, exist_ok=True)
    save(cells, out / "bench.json", out / "bench.png", meta=meta)
    print(f"\nWrote {out / 'bench.json'} and {out / 'bench.png'}")
