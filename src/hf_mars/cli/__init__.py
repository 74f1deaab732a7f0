"""`hf-mars`: decode with a MARS checkpoint, convert the authors' checkpoints, run the toy demo, publish to the Hub.

    hf-mars train --model_name_or_path M --dataset_name D --output_dir O [TRL SFT arguments] [--mars_block_size 4]
    hf-mars demo [--steps 800] [--block-size 4] [--output-dir outputs/mars-demo]
    hf-mars generate [MODEL] [--prompt "..."] [--tau 0.9] [--lossless [--draft-candidates N] [--lookup L]] [--no-compare]
    hf-mars tune [MODEL] [--limit 8] [--trees 2x3+4 ...] [--save]    (the fastest lossless draft tree on this machine)
    hf-mars convert SRC DST [--block-size 4] [--tau 0.9]
    hf-mars push DIR REPO_ID [--private] [--revision BRANCH] [--tau-table FILE] [--base-model ID] [--license L]
    hf-mars push-space SPACE_ID --model REPO_ID [--folder DIR] [--model-revision REV] [--private]

Hub commands authenticate as huggingface_hub does: the HF_TOKEN environment variable, else `hf auth login`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

DEFAULT_PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"


def _model_path(model: str | None) -> str:
    """The given checkpoint, or the shipped one (built on first use)."""
    if model is not None:
        return model
    from ..tools.shipped import default_checkpoint

    return str(default_checkpoint())


def _load(model_path: str | None, revision: str | None, dtype: str):
    """Load a MARS checkpoint with this installed hf_mars's decoding code.

    The checkpoint's own remote-code files are not run: its weights load as the plain base class, which then becomes
    the MARS class of this package. So the CLI needs no `trust_remote_code`, and a checkpoint saved by an older
    hf_mars decodes with every feature of this one.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..decoding.modeling import mars_class

    model_path = _model_path(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path, revision=revision)
    model = AutoModelForCausalLM.from_pretrained(model_path, revision=revision, dtype=getattr(torch, dtype)).eval()
    if getattr(model.config, "mars_mask_token_id", None) is None:
        raise SystemExit(f"{model_path} is not a MARS checkpoint (no mars_mask_token_id in its config).")
    model.__class__ = mars_class(type(model))
    return model, tokenizer


def _encode(tokenizer, prompt: str, chat: bool):
    if chat and tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return tokenizer(prompt, return_tensors="pt")


def _mask_cost(text: str):
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number >= 0 or `auto`, not {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"a number >= 0 or `auto`, not {text!r}")
    return value


def _tree(text: str) -> tuple[int, int, int]:
    """`BxN` or `BxN+L` for `bench --lossless-trees`: block size B >= 2, N >= 1 candidates for the first draft, L
    tokens drafted by prompt lookup (default 0)."""
    tree, _, lookup = text.partition("+")
    block, _, n = tree.partition("x")
    lookup = lookup or "0"
    if not (block.isdigit() and n.isdigit() and lookup.isdigit() and int(block) >= 2 and int(n) >= 1):
        raise argparse.ArgumentTypeError(f"BxN or BxN+L with B >= 2, N >= 1, L >= 0 (e.g. 2x3+4), not {text!r}")
    return int(block), int(n), int(lookup)


def cmd_generate(args) -> None:
    from transformers import GenerationMixin, TextStreamer

    from ..decoding.generate import mars_settings

    model, tokenizer = _load(args.model, args.revision, args.dtype)
    inputs = _encode(tokenizer, args.prompt, not args.raw)
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    if not args.lossless and (args.draft_candidates is not None or args.lookup is not None):
        raise SystemExit("--draft-candidates and --lookup shape lossless drafts: add --lossless.")
    tau = args.tau if args.tau is not None or args.lossless else 0.9  # lossless: the checkpoint's mars_lossless
    mars = dict(mars_tau=tau, mars_verify=args.lossless, mars_block_size=args.block_size,
                mars_draft_candidates=args.draft_candidates, mars_lookup=args.lookup)  # fmt: skip
    mask_cost = args.mask_cost
    if mask_cost == "auto":  # measured for 1 .. B-1 masks of the model's B; this run's B may be smaller
        from ..tools.bench import measure_mask_cost

        mask_cost = measure_mask_cost(model)[: mars_settings(model, **mars)["mars_block_size"] - 1]
    mars["mars_mask_cost"] = mask_cost
    settings = mars_settings(model, **mars)  # what generate() will run with, defaults resolved

    if not args.no_compare:  # warm both paths up, so that neither timing pays for first-call set-up
        GenerationMixin.generate(model, **inputs, max_new_tokens=4, do_sample=False)
        model.generate(**inputs, max_new_tokens=4, **mars)

    mode = "lossless " if args.lossless else ""
    tree = f", {settings['mars_draft_candidates']} draft candidates, lookup {settings['mars_lookup']}" if args.lossless else ""
    print(f"[MARS {mode}τ={settings['mars_tau']}, block size {settings['mars_block_size']}{tree}, "
          f"mask cost {settings['mars_mask_cost']}]", file=sys.stderr)  # fmt: skip
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = time.perf_counter()
    out = model.generate(**inputs, **common, **mars, streamer=streamer, return_dict_in_generate=True)
    mars_seconds = time.perf_counter() - start
    stats = out.mars_stats
    new = int(stats.new_tokens[0])
    print(
        f"\n[{new} tokens in {stats.forward_passes} forward passes: {stats.mean_tokens_per_forward:.2f} tokens/forward, "
        f"{new / mars_seconds:.1f} tokens/s]",
        file=sys.stderr,
    )
    if args.no_compare:
        return
    # The reference is transformers' own generate() (with its KV cache), not our loop at τ = 1.
    start = time.perf_counter()
    ar = GenerationMixin.generate(model, **inputs, **common)
    ar_seconds = time.perf_counter() - start
    ar_new = ar.shape[1] - inputs["input_ids"].shape[1]
    same = torch.equal(ar[0], out.sequences[0])
    print(
        f"[plain AR generate(): {ar_new} tokens, {ar_new / ar_seconds:.1f} tokens/s; "
        f"MARS speed-up {(new / mars_seconds) / (ar_new / ar_seconds):.2f}x; output identical to AR: {same}]",
        file=sys.stderr,
    )


def cmd_convert(args) -> None:
    from ..convert import convert_checkpoint

    dst = convert_checkpoint(args.src, args.dst, block_size=args.block_size, tau=args.tau)
    print(f"Wrote {dst}: load it with AutoModelForCausalLM.from_pretrained({str(dst)!r}, trust_remote_code=True)")


def _hub_errors(push):
    """Hub refusals (no token, no write access, ...) as one line, like the library's ValueErrors."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return push()
    except HfHubHTTPError as err:
        raise SystemExit(f"hf-mars: the Hub refused: {err}") from err


def cmd_push(args) -> None:
    from ..hub import push_to_hub

    result = _hub_errors(lambda: push_to_hub(
        args.folder, args.repo_id, private=args.private or None, revision=args.revision, base_model=args.base_model,
        license=args.license, datasets=args.dataset, tau_table=args.tau_table, commit_message=args.commit_message,
    ))
    print(result.summary())
    pin = f", revision={result.commit_sha!r}"
    print(f"Load it with AutoModelForCausalLM.from_pretrained({args.repo_id!r}{pin}, trust_remote_code=True)")


def cmd_push_space(args) -> None:
    from ..hub import push_space

    result = _hub_errors(lambda: push_space(args.space_id, args.model, folder=args.folder, private=args.private or None,
                                            model_revision=args.model_revision, commit_message=args.commit_message))
    print(result.summary())
    print(f"Space variable MARS_MODEL={args.model}" + (f", MARS_REVISION={args.model_revision}" if args.model_revision else ""))


def cmd_demo(args) -> None:
    from ..tools.demo import run_demo

    run_demo(steps=args.steps, block_size=args.block_size, output_dir=args.output_dir, tau=args.tau)


def cmd_bench(args) -> None:
    from ..tools.bench import format_table, load_prompts, measure_mask_cost, run_benchmark, save

    model, tokenizer = _load(args.model, args.revision, args.dtype)
    if args.device:
        model.to(args.device)
    prompts = load_prompts(args.prompts, tokenizer, limit=args.limit)
    costs = {b: measure_mask_cost(model, b) for b in args.batch_sizes}  # once: printed, saved, and used by `auto`
    cells = run_benchmark(
        model,
        tokenizer,
        prompts,
        taus=args.taus,
        batch_sizes=args.batch_sizes,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        verify=not args.no_lossless,
        prompt_lookup=args.prompt_lookup,
        mask_costs=args.mask_costs,
        measured_costs=costs,
        trees=args.lossless_trees,
    )
    device = f"{model.device.type} ({torch.cuda.get_device_name() if model.device.type == 'cuda' else f'{torch.get_num_threads()} threads'})"
    print(f"\n{args.model or 'the shipped checkpoint'} on {device}, {args.dtype}, {model.config._attn_implementation}, {len(prompts)} prompts\n")
    print(format_table(cells))
    print("\nmars_mask_cost measured here (what 1, 2, ... masks add to a one-token pass), by batch size: "
          + "; ".join(f"{b}: {c}" for b, c in costs.items()))  # fmt: skip
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(model=args.model or "shipped", device=device, dtype=args.dtype, prompts=len(prompts),
                max_new_tokens=args.max_new_tokens, mask_cost=costs)  # fmt: skip
    save(cells, out / "bench.json", out / "bench.png", meta=meta)
    print(f"\nWrote {out / 'bench.json'} and {out / 'bench.png'}")


def cmd_tune(args) -> None:
    from ..tools.bench import format_table, load_prompts, save_lossless_preset, tune_lossless

    folder = Path(_model_path(args.model))
    if args.save and not folder.is_dir():  # say so before minutes of measuring
        raise SystemExit(f"--save writes into a local checkpoint folder; {args.model} is not one.")
    model, tokenizer = _load(args.model, args.revision, args.dtype)
    if args.device:
        model.to(args.device)
    prompts = load_prompts(args.prompts, tokenizer, limit=args.limit)
    best, fastest, cells = tune_lossless(model, tokenizer, prompts, trees=args.trees, taus=args.taus, batch_size=args.batch_size,
                                max_new_tokens=args.max_new_tokens, repeats=args.repeats)  # fmt: skip
    device = model.device.type if model.device.type != "cpu" else f"cpu, {torch.get_num_threads()} threads"
    print(f"\nLossless draft trees on {device}, {args.dtype}, batch {args.batch_size}, {len(prompts)} prompts:\n")
    print(format_table(cells))
    ar = next(c for c in cells if c.method == "ar")
    print(f"\nFastest: {fastest.method}, {fastest.speedup:.2f}x plain generate() ({ar.tokens_per_second:.1f} tokens/s)"
          f" -> mars_lossless = {best}")  # fmt: skip
    if fastest.speedup < 1.0:
        print("No draft tree beat plain generate() here: passes over several tokens cost too much on this machine.")
    if args.save:
        written = save_lossless_preset(folder, best, args.batch_size)
        print(f"Saved to {written} for batch size {args.batch_size} and up: generate(mars_verify=True) now uses it.")


def cmd_distill(args) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..tools.data import distill, training_prompts, write_reference_set, write_training_set
    from ..tools.shipped import base_checkpoint

    base = base_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, args.dtype)).eval()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = training_prompts(args.n_math, args.n_gym, args.n_code, seed=args.seed)
    distill(model, tokenizer, prompts, out / "distilled.jsonl", max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    kept, total = write_training_set(out / "distilled.jsonl", out / "train.jsonl")
    print(f"{kept} of {total} answers finished within {args.max_new_tokens} tokens: wrote {out / 'train.jsonl'}")
    if args.references:
        count = write_reference_set(out / "train.jsonl", prompts, out / "train_reference.jsonl")
        print(f"the same {count} prompts with the datasets' reference answers: wrote {out / 'train_reference.jsonl'}")


def cmd_export_delta(args) -> None:
    from ..tools.shipped import DELTA_DIR, export_delta

    dst = export_delta(args.trained, args.output or DELTA_DIR)
    size = sum(f.stat().st_size for f in dst.iterdir()) / 2**20
    print(f"Wrote the delta to {dst} ({size:.1f} MB)")


def cmd_eval(args) -> None:
    import json

    from transformers import AutoModelForCausalLM

    from ..tools.evals import eval_prompts, format_tau_table, tau_table
    from ..tools.shipped import base_checkpoint

    model, tokenizer = _load(args.model, None, args.dtype)
    base = None
    if args.base:
        base = AutoModelForCausalLM.from_pretrained(base_checkpoint(), dtype=getattr(torch, args.dtype)).eval()
    rows = eval_prompts(args.gsm8k, args.humaneval)
    table = tau_table(model, tokenizer, rows, taus=args.taus, base_model=base, batch_size=args.batch_size,
                      max_new_tokens=args.max_new_tokens)  # fmt: skip
    text = format_tau_table(table)
    print(text)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(model=args.model or "shipped", gsm8k=args.gsm8k, humaneval=args.humaneval, dtype=args.dtype,
                max_new_tokens=args.max_new_tokens, threads=torch.get_num_threads())  # fmt: skip
    (out / "eval.json").write_text(json.dumps({"meta": meta, "rows": table}, indent=2))
    (out / "eval.md").write_text(text + "\n")
    print(f"Wrote {out / 'eval.json'} and {out / 'eval.md'}")


def build_parser() -> argparse.ArgumentParser:
    from ..tools.bench import TUNE_TREES

    parser = argparse.ArgumentParser(prog="hf-mars", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream an answer with MARS decoding, then compare with plain AR generate()")
    gen.add_argument("model", nargs="?", help="MARS checkpoint: a local folder or a Hub repo id (default: the shipped one)")
    gen.add_argument("--prompt", default=DEFAULT_PROMPT)
    gen.add_argument("--tau", type=float,
                     help="confidence threshold in [0, 1]; 1 = plain AR (default 0.9; lossless: the checkpoint's)")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--revision", help="pin a Hub revision: remote code runs on your machine")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    gen.add_argument("--no-compare", action="store_true", help="skip the plain AR run")
    gen.add_argument("--lossless", action="store_true",
                     help="verify the mask drafts (mars_verify): exactly the greedy AR text, τ sets how many drafts; "
                          "the draft tree defaults to the checkpoint's mars_lossless (see `tune`)")
    gen.add_argument("--block-size", type=int, help="mars_block_size: at most B tokens per pass (default: the model's)")
    gen.add_argument("--draft-candidates", type=int,
                     help="lossless: candidates for the first draft (mars_draft_candidates; 3 was fastest on a CPU)")
    gen.add_argument("--lookup", type=int,
                     help="lossless: also draft up to L tokens by prompt lookup (mars_lookup; 4 was fastest on a CPU)")
    gen.add_argument("--mask-cost", type=_mask_cost, default=0.0,
                     help="mars_mask_cost: a mask's share of a pass's time (0 = B-1 masks every pass), or `auto`: "
                          "measure it on this machine first")
    gen.set_defaults(func=cmd_generate)

    # `train` is dispatched in main() to TRL's parser; listed here for --help
    sub.add_parser("train", help="train a MARS model: TRL sft.py arguments plus --mars_block_size/--mars_ar_weight")

    demo = sub.add_parser("demo", help="train a toy MARS model on CPU (minutes, offline), then decode and compare with AR")
    demo.add_argument("--steps", type=int, default=800)
    demo.add_argument("--block-size", type=int, default=4)
    demo.add_argument("--tau", type=float, default=0.9, help="τ of the wall-clock comparison (default 0.9)")
    demo.add_argument("--output-dir", default="outputs/mars-demo")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="MARS vs plain AR and prompt-lookup decoding: tokens/forward, speed, agreement")
    bench.add_argument("model", nargs="?", help="MARS checkpoint: a local folder or a Hub repo id (default: the shipped one)")
    bench.add_argument("--prompts", default="heldout",
                       help="JSONL file (prompt or messages, optional answer), or `heldout` (GSM8K + HumanEval, default) or `toy`")
    bench.add_argument("--limit", type=int, default=32, help="use the first N prompts (default 32)")
    bench.add_argument("--taus", type=float, nargs="+", default=[1.0, 0.95, 0.9, 0.8, 0.7])
    bench.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--repeats", type=int, default=3, help="timed repeats; the median is reported")
    bench.add_argument("--prompt-lookup", type=int, default=10, help="prompt_lookup_num_tokens of the peer (0: skip it)")
    bench.add_argument("--no-lossless", action="store_true", help="skip the lossless (mars_verify) runs")
    bench.add_argument("--mask-costs", type=_mask_cost, nargs="+", default=[0.0, "auto"],
                       help="values of mars_mask_cost to measure: 0 (B-1 masks every pass), a cost per mask, or `auto` "
                            "(measured at each batch size); default: 0 auto")
    bench.add_argument("--lossless-trees", type=_tree, nargs="+", default=[], metavar="BxN[+L]",
                       help="also measure lossless mode with mars_block_size=B, mars_draft_candidates=N and "
                            "mars_lookup=L, e.g. 2x3 or 2x3+4")
    bench.add_argument("--revision")
    bench.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    bench.add_argument("--device", help="e.g. cuda (default: where the model loads)")
    bench.add_argument("--output", default="outputs/bench", help="folder for bench.json and bench.png")
    bench.set_defaults(func=cmd_bench)

    tune = sub.add_parser("tune", help="measure lossless draft trees against plain generate() and pick the fastest")
    tune.add_argument("model", nargs="?", help="MARS checkpoint: a local folder or a Hub repo id (default: the shipped one)")
    tune.add_argument("--prompts", default="heldout", help="JSONL file, or `heldout` (default) or `toy` (see bench)")
    tune.add_argument("--limit", type=int, default=8, help="use the first N prompts (default 8)")
    tune.add_argument("--trees", type=_tree, nargs="+", metavar="BxN[+L]", default=list(TUNE_TREES),
                      help="draft trees to try: block size B, N candidates for the first draft, L prompt-lookup tokens "
                           "(default: " + " ".join(f"{b}x{n}+{lookup}" for b, n, lookup in TUNE_TREES) + ")")
    tune.add_argument("--taus", type=float, nargs="+", default=[0.0], help="τ values to try (default 0: every draft)")
    tune.add_argument("--batch-size", type=int, default=1,
                      help="batch size to tune for; --save keeps other batch sizes' trees (a batch uses the entry of "
                           "the largest size it reaches)")
    tune.add_argument("--max-new-tokens", type=int, default=96)
    tune.add_argument("--repeats", type=int, default=1, help="timed repeats; the median is reported")
    tune.add_argument("--save", action="store_true",
                      help="write the fastest into the checkpoint's generation_config.json as mars_lossless")
    tune.add_argument("--revision")
    tune.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                      help="tune in the dtype you decode in: the fastest tree depends on it")
    tune.add_argument("--device", help="e.g. cuda (default: where the model loads)")
    tune.set_defaults(func=cmd_tune)

    dist = sub.add_parser("distill", help="recipe step 1: training prompts answered by the base model itself (greedy)")
    dist.add_argument("--output-dir", default="outputs/recipe", help="writes distilled.jsonl (all) and train.jsonl (finished)")
    dist.add_argument("--n-math", type=int, default=450, help="reasoning-gym gsm_symbolic problems")
    dist.add_argument("--n-gym", type=int, default=250, help="short reasoning-gym tasks, spread over several generators")
    dist.add_argument("--n-code", type=int, default=300, help="MBPP problems")
    dist.add_argument("--max-new-tokens", type=int, default=192)
    dist.add_argument("--batch-size", type=int, default=40)
    dist.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    dist.add_argument("--seed", type=int, default=0)
    dist.add_argument("--references", action="store_true",
                      help="also write train_reference.jsonl: the same prompts, answered by the datasets' references")  # fmt: skip
    dist.set_defaults(func=cmd_distill)

    exp = sub.add_parser("export-delta", help="recipe step 3: store a LoRA MARS run as the shipped delta (float16, <= 25 MB)")
    exp.add_argument("trained", help="output folder of `hf-mars train --use_peft ...`")
    exp.add_argument("--output", help="default: the package's checkpoints/smollm2-135m-mars")
    exp.set_defaults(func=cmd_export_delta)

    ev = sub.add_parser("eval", help="recipe step 4: tokens/forward, agreement with τ = 1 and GSM8K/HumanEval accuracy per τ")
    ev.add_argument("model", nargs="?", help="MARS checkpoint (default: the shipped one)")
    ev.add_argument("--taus", type=float, nargs="+", default=[1.0, 0.95, 0.9, 0.8, 0.7])
    ev.add_argument("--gsm8k", type=int, default=100, help="first N GSM8K test problems")
    ev.add_argument("--humaneval", type=int, default=50, help="first N HumanEval problems")
    ev.add_argument("--base", action="store_true", help="also score the base model (the shipped base) with plain generate()")
    ev.add_argument("--batch-size", type=int, default=16)
    ev.add_argument("--max-new-tokens", type=int, default=256)
    ev.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ev.add_argument("--output", default="outputs/eval", help="folder for eval.json and eval.md")
    ev.set_defaults(func=cmd_eval)

    conv = sub.add_parser("convert", help="convert an authors' MARS checkpoint (model_type a2d-qwen2)")
    conv.add_argument("src")
    conv.add_argument("dst")
    conv.add_argument("--block-size", type=int, help="B the checkpoint was trained with (default: from its config, else 4)")
    conv.add_argument("--tau", type=float, help="default τ to store in the generation config")
    conv.set_defaults(func=cmd_convert)

    push = sub.add_parser("push", help="upload a MARS checkpoint (safetensors, remote code, tokenizer) with a model card")
    push.add_argument("folder", help="a MARS checkpoint folder saved by hf_mars, tokenizer included")
    push.add_argument("repo_id", help="Hub model repo, namespace/name (created if missing)")
    push.add_argument("--private", action="store_true", help="create the repo private")
    push.add_argument("--revision", help="branch to commit to (created from main if missing)")
    push.add_argument("--base-model", help="card metadata (default: from the folder's README.md or config)")
    push.add_argument("--license", help="card metadata, e.g. apache-2.0 (default: from the folder's README.md)")
    push.add_argument("--dataset", action="append", help="card metadata; repeat for several datasets")
    push.add_argument("--tau-table", help="JSON file of measured rows {tau, tokens_per_forward, ...} for the card")
    push.add_argument("--commit-message")
    push.set_defaults(func=cmd_push)

    space = sub.add_parser("push-space", help="upload the Gradio Space folder and point it at a MARS model repo")
    space.add_argument("space_id", help="Hub Space, namespace/name (created if missing)")
    space.add_argument("--model", required=True, help="the MARS model repo the Space loads (its MARS_MODEL variable)")
    space.add_argument("--model-revision", help="pin the model's revision (MARS_REVISION): its remote code runs in the Space")
    space.add_argument("--folder", help="the Space's files (default: the project's spaces_demo/)")
    space.add_argument("--private", action="store_true", help="create the Space private")
    space.add_argument("--commit-message")
    space.set_defaults(func=cmd_push_space)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:  # TRL's own parser takes the rest (argparse would claim --help and friends)
        from ..training.train import run

        return run(argv[1:])
    args = build_parser().parse_args(argv)
    if getattr(args, "tau", None) is not None and not 0.0 <= args.tau <= 1.0:
        raise SystemExit(f"--tau must be in [0, 1], got {args.tau}")
    try:
        args.func(args)
    except ValueError as err:  # bad input named by the library: say it, without a traceback
        raise SystemExit(f"hf-mars: {err}") from err


if __name__ == "__main__":
    main()
