"""`hf-mars generate`: stream one answer with MARS decoding, then time transformers' own `generate()` on it."""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

from .options import DTYPES, add_attention, add_decoding, add_model, decoding_kwargs, describe_decoding, mask_cost

# Speed-ups whose runs spread over more than this share of their median are said to be rough
SPREAD = 0.25
# Plain decoding in another dtype that timed pass costs expect at under this share of this dtype's is not run
SLOWER = 0.9

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
    "two tokens nearly tie the texts can part; --attention ordered or --dtype float32 keeps them identical)"
)
# Said where lossless mode ran no tree, in place of a comparison of plain decoding with itself
PLAINLY = (
    "[lossless mode ran plain generate() itself: no draft tree pays in {} on this machine (its pass costs), so its "
    "tokens and its speed are plain decoding's and there is nothing to compare; --tau 0.9 drafts without checking]"
)
# Said instead of the texts' identity where both sides sample (and, where the mode keeps plain's text, the second part)
SAMPLED = ("sampled: each side draws its own text", " (this mode's is distributed as plain sampling's)")


def add_parser(subparsers) -> None:
    gen = subparsers.add_parser("generate", help=HELP, description=DESCRIPTION)
    add_model(gen)
    gen.add_argument("--prompt", default=DEFAULT_PROMPT, help="the request, in the chat template unless --raw")
    gen.add_argument(
        "--tau",
        type=float,
        help="τ-mode: confidence threshold in [0, 1], 1 = plain AR (default: lossless mode; with --lossless, τ sets "
        "how many drafts, default the checkpoint's)",
    )
    gen.add_argument("--max-new-tokens", type=int, default=256, help="most tokens to generate, each run")
    gen.add_argument("--revision", help="pin a Hub revision: remote code runs on your machine")
    gen.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="`auto` (default): the dtype where lossless decoding is expected fastest on this machine, from pass "
        "costs measured here (once, cached; said with the reason); float32: lossless output identical to float32 "
        "generate() whatever the ties",
    )
    add_attention(gen)
    gen.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    gen.add_argument("--no-compare", action="store_true", help="skip the plain AR runs")
    gen.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of each side (MARS, and plain generate() in each dtype that may be the fastest), taking turns, "
        "the streamed answer first: the median speed-up and its spread are printed",
    )
    gen.add_argument(
        "--compare-tokens",
        type=int,
        default=32,
        help="most new tokens of each run after the first (the streamed answer and plain decoding of its length)",
    )
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
    from ..tools.measure.cpu_load import clocks, cpu_share, decode_on_free_cores
    from ..tools.measure.passes import measure

    by_default = args.tau is None and not args.lossless
    args.lossless = args.lossless or by_default
    if not args.lossless and (args.draft_candidates is not None or args.lookup is not None):
        raise SystemExit("--draft-candidates and --lookup shape lossless drafts: add --lossless.")
    if args.typical and args.tau is not None and not args.lossless:
        raise SystemExit("--typical verifies lossless mode's drafts: drop --tau or add --lossless.")
    if args.repeats < 1 or args.compare_tokens < 1:
        raise SystemExit(f"--repeats and --compare-tokens must be at least 1: {args.repeats}, {args.compare_tokens}")
    sampling = decoding_kwargs(args)
    dtype = "float32" if args.dtype == "auto" else args.dtype
    model, tokenizer = load_checkpoint(args.model, args.revision, dtype, attention=args.attention)
    shared = decode_on_free_cores()  # a busy machine's cores would hold every thread of a team back
    if shared:
        print(f"[{shared}]", file=sys.stderr)
    inputs = _encode(tokenizer, args.prompt, not args.raw)
    expected = None  # plain tokens/s per dtype, where timed pass costs expect them
    if args.dtype == "auto":
        model, expected = _auto_dtype(model, inputs["input_ids"].shape[1], args.max_new_tokens)
    mars = _mars_arguments(args)
    measure(model, [1], **mars)  # what "auto" settings read (seconds, once per machine; none on a busy one)
    run = {"max_new_tokens": args.max_new_tokens, "do_sample": False, **sampling}  # both sides decode so
    plainly = _print_settings(model, mars, args.lossless, describe_decoding(args))
    compare = not (args.no_compare or plainly)
    if compare:  # warm both paths up, so that neither timing pays for first-call set-up
        _warm_up(model, inputs, mars, run)
    started = clocks()
    out, rate = _stream(model, tokenizer, inputs, mars, run, args.seed)
    if plainly and not args.no_compare:
        print(PLAINLY.format(_name(model.dtype)), file=sys.stderr)
    if compare:
        exact = (args.lossless and not args.typical) or (args.tau is not None and args.tau >= 1.0)
        short = {**run, "max_new_tokens": min(args.compare_tokens, args.max_new_tokens)}
        dtypes = _contenders(model, expected)
        runs = _interleaved(model, inputs, mars, run, short, args.seed, args.repeats, dtypes, rate)
        _report(model, out, runs, run["do_sample"], exact, cpu_share(started))
    if by_default:
        print(TAU_NOTE.format("distribution" if sampling.get("do_sample") else "text"), file=sys.stderr)


def _auto_dtype(model, prompt_tokens: int, new_tokens: int):
    from ..tools.measure.dtypes import choose_dtype, in_dtype

    choice = choose_dtype(model, 1, prompt_tokens, new_tokens)
    print(f"[{choice.reason()}]", file=sys.stderr)
    return in_dtype(model, choice.dtype), None if choice.prior else choice.plain


def _contenders(model, expected: dict | None) -> list:
    """The dtypes whose plain `generate()` MARS is set against: this one first, then each other this machine runs
    unless timed pass costs expect its plain decoding at under `SLOWER` of this dtype's (unlikely to be the fastest
    plain decoder here, and would double the comparison's time; said)."""
    from ..tools.measure.dtypes import candidate_dtypes

    dtypes = sorted(candidate_dtypes(model), key=lambda d: d != model.dtype)
    if not expected:
        return dtypes
    kept = [d for d in dtypes if expected[d] >= SLOWER * expected[model.dtype]]
    for dtype in dtypes:
        if dtype not in kept:
            print(
                f"[plain generate() in {_name(dtype)} not run: the pass costs timed here expect "
                f"{expected[dtype]:.1f} tokens/s, against {expected[model.dtype]:.1f} in {_name(model.dtype)}]",
                file=sys.stderr,
            )
    return kept


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


def _warm_up(model, inputs, mars: dict, run: dict, tokens: int = 8) -> None:
    """A few tokens of each. MARS's with the run's own budget, stopped early by a criterion: its static cache is sized
    by the budget, and on a GPU its pass compiles and is captured for that size (the cache kept for later calls, which
    the shorter runs fit in), so that no timed run pays for compiling."""
    import torch
    from transformers import GenerationMixin
    from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

    class After(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            stop = input_ids.shape[1] >= inputs["input_ids"].shape[1] + tokens
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

    GenerationMixin.generate(model, **inputs, **{**run, "max_new_tokens": tokens})
    model.generate(**inputs, **mars, **run, stopping_criteria=StoppingCriteriaList([After()]))


def _print_settings(model, mars: dict, lossless: bool, decoding: str) -> bool:
    """What generate() runs with, defaults resolved, so that a run says which tree and τ it measured. True where that
    is plain `generate()` itself: lossless mode with no tree (`"auto"` found none that pays), whose tokens and costs
    are plain decoding's, so that a comparison would time plain decoding against itself."""
    from ..decoding.settings import resolve_settings

    resolved = resolve_settings(model, **mars)
    settings = resolved.as_kwargs()
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
    return resolved.plain


def _stream(model, tokenizer, inputs, mars: dict, run: dict, seed: int):
    """Decode with MARS (`run`: how tokens are chosen, sampled from `seed`), streaming the text to stdout, and say
    its tokens per forward and rate."""
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
    return out, new / seconds


@dataclass
class Runs:
    """Tokens per second of each run, round by round: MARS's and plain `generate()`'s in each dtype (this one
    first), each side's run of a round beside the others'. The first round is the streamed answer and plain decoding
    of the same length (`plain_out`: their outputs, whose texts are compared); the others are shorter."""

    mars: list[float]
    plain: dict  # dtype -> [tokens/s]
    plain_out: dict  # dtype -> token ids of the first round


def _interleaved(model, inputs, mars: dict, run: dict, short: dict, seed: int, repeats: int, dtypes, streamed: float):
    """Plain `generate()` in each of `dtypes` as long as the streamed answer (`run`; that answer ran at `streamed`
    tokens/s), then `repeats - 1` more rounds of each side decoding as `short` says, taking turns, so that a machine
    that slows down or speeds up weighs on both alike. The reference is transformers' own `generate()` (its KV cache,
    not the MARS loop at τ = 1), in this dtype and the others given, so that MARS is also set against the fastest
    plain decoding here; each run starts from `seed` (sampled runs draw alike)."""
    import torch
    from transformers import GenerationMixin

    from ..tools.measure.dtypes import in_dtype

    prompt = inputs["input_ids"].shape[1]
    plains = {d: in_dtype(model, d) for d in dtypes}
    for plain in plains.values():
        if plain is not model:
            GenerationMixin.generate(plain, **inputs, **{**run, "max_new_tokens": 4})  # warm-up
    runs = Runs([streamed], {d: [] for d in plains}, {})
    for round_ in range(repeats):
        if round_:
            torch.manual_seed(seed)
            start = time.perf_counter()
            out = model.generate(**inputs, **short, **mars, return_dict_in_generate=True)
            runs.mars.append(int(out.mars_stats.new_tokens[0]) / (time.perf_counter() - start))
        for dtype, plain in plains.items():
            torch.manual_seed(seed)
            start = time.perf_counter()
            ar = GenerationMixin.generate(plain, **inputs, **(short if round_ else run))
            runs.plain[dtype].append((ar.shape[1] - prompt) / (time.perf_counter() - start))
            runs.plain_out.setdefault(dtype, ar)
    return runs


def _report(model, out, runs: Runs, sampled: bool, exact: bool, share: float) -> None:
    """Plain decoding's rate beside the streamed answer's and whether the texts are identical (`exact`: the mode keeps
    plain's text, so a greedy difference outside float32 is said to be rounding; sampled texts are drawn apart, so no
    identity is claimed); the speed-up against plain decoding in each dtype (the median of the rounds' ratios, with
    their range); and what would make the figures mean less: a machine busy with other work, wide spread, one token
    a pass."""
    import torch

    name, prompt = _name(model.dtype), out.sequences.shape[1] - int(out.mars_stats.new_tokens[0])
    ar = runs.plain_out[model.dtype]
    same = torch.equal(ar[0], out.sequences[0])
    why = NEAR_TIE.format(name) if not same and exact and model.dtype != torch.float32 else ""
    said = SAMPLED[0] + SAMPLED[1] * exact if sampled else f"output identical to AR: {same}{why}"
    print(
        f"[plain AR generate() ({name}): {ar.shape[1] - prompt} tokens, {runs.plain[model.dtype][0]:.1f} tokens/s; "
        f"{said}]",
        file=sys.stderr,
    )
    ratios = {d: [m / p for m, p in zip(runs.mars, rates)] for d, rates in runs.plain.items()}
    against = "; ".join(f"against plain {_name(d)} {_spread(r)}" for d, r in ratios.items())
    print(f"[MARS speed-up, median of {len(runs.mars)} interleaved runs: {against}]", file=sys.stderr)
    fastest = max(runs.plain, key=lambda d: statistics.median(runs.plain[d]))
    print(
        f"[fastest plain generate() here: {_name(fastest)}; MARS ({name}) {statistics.median(ratios[fastest]):.2f}x "
        "it]",
        file=sys.stderr,
    )
    for caveat in _caveats(out.mars_stats, ratios[model.dtype], share):
        print(f"[{caveat}]", file=sys.stderr)


def _spread(ratios: list[float]) -> str:
    """`median` and, over several runs, `(min to max)`."""
    middle = f"{statistics.median(ratios):.2f}x"
    return middle if len(ratios) < 2 else f"{middle} ({min(ratios):.2f}x to {max(ratios):.2f}x)"


def _caveats(stats, ratios: list[float], share: float) -> list[str]:
    """What makes the speed-up mean less than it says."""
    from ..tools.measure.cpu_load import BUSY_SHARE

    said = []
    if share < BUSY_SHARE:
        said.append(
            f"other work held the CPU during these runs (this process had {100 * share:.0f}% of its threads' CPU "
            "time): the speed-ups are noise; run again on an idle machine"
        )
    elif len(ratios) > 1 and (max(ratios) - min(ratios)) > SPREAD * statistics.median(ratios):
        said.append(
            f"the runs' speed-ups spread over {max(ratios) - min(ratios):.2f}x: the machine's own variation is that "
            "large; take the median as rough"
        )
    if stats.forward_passes and stats.mean_tokens_per_forward < 1.005:
        said.append(
            "MARS made one token a pass here, as plain decoding does (no draft tree pays on this machine, or τ kept "
            "no guess): its speed-up is only what each pass costs beside a plain step, and the machine's spread"
        )
    return said


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")
