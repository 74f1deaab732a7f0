"""`hf-mars generate`: stream one answer with MARS decoding, then time transformers' own `generate()` on it."""

from __future__ import annotations

import sys
import time

from .options import DTYPES, add_decoding, add_model, decoding_kwargs, describe_decoding, mask_cost

# A request the shipped 135M checkpoint answers correctly and without looping (a looping answer would also flatter
# prompt lookup, which drafts from repeated text)
DEFAULT_PROMPT = "Write a Python function that returns the sum of the squares of a list of numbers."
HELP = "stream a MARS answer, then compare with plain generate()"
DESCRIPTION = (
    "Stream an answer with MARS decoding, then compare with plain AR generate(). Without --tau it runs lossless "
    "mode with the checkpoint's draft tree: exactly the AR text, in fewer forward passes; --tau τ runs τ-mode, which "
    "accepts mask predictions while their confidence is at least τ and may change the text."
)
# Said after a default (lossless) run, so that a first run knows what the other mode trades
TAU_NOTE = (
    "[τ-mode (--tau 0.9) accepts the masks' guesses without checking them: more tokens per pass where the model is "
    "confident, but the text can change and quality drops; lossless mode, this run, keeps plain generate()'s {}]"
)
# Said where a mode that keeps greedy's text did not, outside float32
NEAR_TIE = (
    " ({}: a pass over several tokens sums in another order than a one-token step and rounds differently, so where "
    "two tokens nearly tie the texts can part; --dtype float32 keeps them identical)"
)
# Said instead of the texts' identity where both sides sample (and, where the mode keeps plain's text, the second part)
SAMPLED = ("sampled: each side draws its own text", " (this mode's is distributed as plain sampling's)")


def add_parser(subparsers) -> None:
    gen = subparsers.add_parser("generate", help=HELP, description=DESCRIPTION)
    add_model(gen)
    gen.add_argument("--prompt", default=DEFAULT_PROMPT)
    gen.add_argument(
        "--tau",
        type=float,
        help="τ-mode: confidence threshold in [0, 1], 1 = plain AR (default: lossless mode; with --lossless, τ sets "
        "how many drafts, default the checkpoint's)",
    )
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--revision", help="pin a Hub revision: remote code runs on your machine")
    gen.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="`auto` (default): the dtype where lossless decoding is expected fastest on this machine, from pass "
        "costs measured here (once, cached; said with the reason); float32: lossless output identical to float32 "
        "generate() whatever the ties",
    )
    gen.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    gen.add_argument("--no-compare", action="store_true", help="skip the plain AR run")
    _add_mars_options(gen)
    add_decoding(
        gen,
        "sample at this temperature, MARS and plain AR alike, each from --seed (default: greedy). Lossless mode's "
        "text is then distributed as plain sampling's (speculative sampling), drawn otherwise",
    )
    gen.add_argument("--seed", type=int, default=0, help="the seed each sampled run starts from (default 0)")
    gen.set_defaults(run=run)


def _add_mars_options(gen) -> None:
    """How MARS decodes: lossless mode and its draft tree, typical acceptance, the mask cost."""
    gen.add_argument(
        "--lossless",
        action="store_true",
        help="verify the mask drafts (mars_verify): exactly the greedy AR text, τ sets how many drafts; "
        "the draft tree defaults to the checkpoint's mars_lossless (see `tune`); the default without --tau",
    )
    gen.add_argument(
        "--block-size", type=int, help="mars_block_size: at most B tokens per pass (default: the model's)"
    )
    gen.add_argument(
        "--draft-candidates",
        type=int,
        nargs="+",
        metavar="N",
        help="lossless: candidates for the first draft, or one count per draft depth (`4 3 2`) "
        "(mars_draft_candidates; `hf-mars tune` finds the fastest)",
    )
    gen.add_argument(
        "--lookup",
        type=int,
        help="lossless: also draft up to L tokens by prompt lookup (mars_lookup; `hf-mars tune` finds the fastest)",
    )
    gen.add_argument(
        "--typical",
        action="store_true",
        help='lossless tree, but drafts kept by typical acceptance (mars_accept="typical"): more tokens per pass, '
        "not the AR text",
    )
    gen.add_argument(
        "--mask-cost",
        type=mask_cost,
        default=0.0,
        help="mars_mask_cost: a mask's share of a pass's time (0 = B-1 masks every pass), or `auto`: "
        "measure it on this machine first",
    )


def run(args) -> None:
    from ..tools.checkpoints.loading import load_checkpoint
    from ..tools.measure.passes import measure

    by_default = args.tau is None and not args.lossless
    args.lossless = args.lossless or by_default
    if not args.lossless and (args.draft_candidates is not None or args.lookup is not None):
        raise SystemExit("--draft-candidates and --lookup shape lossless drafts: add --lossless.")
    if args.typical and args.tau is not None and not args.lossless:
        raise SystemExit("--typical verifies lossless mode's drafts: drop --tau or add --lossless.")
    sampling = decoding_kwargs(args)
    model, tokenizer = load_checkpoint(args.model, args.revision, "float32" if args.dtype == "auto" else args.dtype)
    inputs = _encode(tokenizer, args.prompt, not args.raw)
    if args.dtype == "auto":
        model = _auto_dtype(model, inputs["input_ids"].shape[1], args.max_new_tokens)
    mars = _mars_arguments(args)
    measure(model, [1], **mars)  # what "auto" settings read (once per machine; generate() never times)
    run = {"max_new_tokens": args.max_new_tokens, "do_sample": False, **sampling}  # both sides decode so
    if not args.no_compare:  # warm both paths up, so that neither timing pays for first-call set-up
        _warm_up(model, inputs, mars, run)
    _print_settings(model, mars, args.lossless, describe_decoding(args))
    out, seconds = _stream(model, tokenizer, inputs, mars, run, args.seed)
    if not args.no_compare:
        exact = (args.lossless and not args.typical) or (args.tau is not None and args.tau >= 1.0)
        _compare_with_ar(model, inputs, out, seconds, run, args.seed, exact)
    if by_default:
        print(TAU_NOTE.format("distribution" if sampling.get("do_sample") else "text"), file=sys.stderr)


def _auto_dtype(model, prompt_tokens: int, new_tokens: int):
    from ..tools.measure.dtypes import choose_dtype, in_dtype

    choice = choose_dtype(model, 1, prompt_tokens, new_tokens)
    print(f"[{choice.reason()}]", file=sys.stderr)
    return in_dtype(model, choice.dtype)


def _encode(tokenizer, prompt: str, chat: bool):
    if chat and tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    return tokenizer(prompt, return_tensors="pt")


def _mars_arguments(args) -> dict:
    """The `mars_*` arguments of `generate()`; None leaves a setting to the checkpoint (lossless: mars_lossless)."""
    return dict(
        mars_tau=args.tau,
        mars_verify=args.lossless or None,  # not given: the checkpoint's generation config decides
        mars_block_size=args.block_size,
        mars_draft_candidates=_candidates(args.draft_candidates),
        mars_lookup=args.lookup,
        mars_mask_cost=args.mask_cost,  # "auto": generate() reads this machine's pass costs
        mars_accept="typical" if args.typical else None,
    )


def _candidates(counts: list[int] | None):
    """`--draft-candidates` as `mars_draft_candidates`: one count is N for the first draft, several are per depth."""
    if counts is None:
        return None
    return counts[0] if len(counts) == 1 else counts


def _warm_up(model, inputs, mars: dict, run: dict) -> None:
    from transformers import GenerationMixin

    GenerationMixin.generate(model, **inputs, **{**run, "max_new_tokens": 4})
    model.generate(**inputs, **mars, **{**run, "max_new_tokens": 4})


def _print_settings(model, mars: dict, lossless: bool, decoding: str) -> None:
    """What generate() runs with, defaults resolved, so that a run says which tree and τ it measured."""
    from ..decoding.generate import mars_settings

    settings = mars_settings(model, **mars)
    mode = ("typical-acceptance " if settings["mars_accept"] == "typical" else "lossless ") if lossless else ""
    tree = ""
    if lossless:
        counts = settings["mars_draft_candidates"]
        per_depth = f"draft candidates {','.join(map(str, counts))} per depth" if isinstance(counts, list) else ""
        tree = f", {per_depth or f'{counts} draft candidates'}, lookup {settings['mars_lookup']}"
    print(
        f"[MARS {mode}τ={settings['mars_tau']}, block size {settings['mars_block_size']}{tree}, "
        f"mask cost {settings['mars_mask_cost']}{', ' + decoding if decoding else ''}]",
        file=sys.stderr,
    )


def _stream(model, tokenizer, inputs, mars: dict, run: dict, seed: int):
    """Decode with MARS (`run`: how tokens are chosen, sampled from `seed`), streaming the text to stdout:
    `(output, seconds)`."""
    import torch
    from transformers import TextStreamer

    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = model.generate(**inputs, **run, **mars, streamer=streamer, return_dict_in_generate=True)
    seconds = time.perf_counter() - start
    stats = out.mars_stats
    new = int(stats.new_tokens[0])
    print(
        f"\n[{new} tokens in {stats.forward_passes} forward passes: {stats.mean_tokens_per_forward:.2f} "
        f"tokens/forward, {new / seconds:.1f} tokens/s]",
        file=sys.stderr,
    )
    return out, seconds


def _compare_with_ar(model, inputs, out, mars_seconds: float, run: dict, seed: int, exact: bool) -> None:
    """The reference is transformers' own generate() (with its KV cache), not the MARS loop at τ = 1, decoding as
    `run` says (sampled: from the same `seed`): in this dtype, and in the others this machine runs, so that MARS is
    also set against the fastest plain decoding here. `exact`: the mode keeps plain's text (lossless verification,
    τ = 1), so a greedy difference outside float32 is said to be rounding; sampled texts are drawn apart, so no
    identity is claimed."""
    import torch
    from transformers import GenerationMixin

    from ..tools.measure.dtypes import candidate_dtypes, in_dtype

    new = int(out.mars_stats.new_tokens[0])
    rates = {}
    for dtype in sorted(candidate_dtypes(model), key=lambda d: d != model.dtype):  # this dtype first
        plain = in_dtype(model, dtype)
        if plain is not model:
            GenerationMixin.generate(plain, **inputs, **{**run, "max_new_tokens": 4})  # warm-up
        torch.manual_seed(seed)
        start = time.perf_counter()
        ar = GenerationMixin.generate(plain, **inputs, **run)
        ar_new = ar.shape[1] - inputs["input_ids"].shape[1]
        rates[dtype] = ar_new / (time.perf_counter() - start)
        if dtype == model.dtype:
            same = torch.equal(ar[0], out.sequences[0])
            rounded = not same and exact and dtype != torch.float32
            why = NEAR_TIE.format(str(dtype).removeprefix("torch.")) if rounded else ""
            said = SAMPLED[0] + SAMPLED[1] * exact if run["do_sample"] else f"output identical to AR: {same}{why}"
            print(
                f"[plain AR generate(): {ar_new} tokens, {rates[dtype]:.1f} tokens/s; "
                f"MARS speed-up {(new / mars_seconds) / rates[dtype]:.2f}x; {said}]",
                file=sys.stderr,
            )
    fastest = max(rates, key=rates.get)
    print(
        f"[fastest plain generate() here: {str(fastest).removeprefix('torch.')}, {rates[fastest]:.1f} tokens/s; "
        f"MARS ({str(model.dtype).removeprefix('torch.')}) {(new / mars_seconds) / rates[fastest]:.2f}x it]",
        file=sys.stderr,
    )
