"""What one MARS pass costs against one step of compiled plain `generate()`, on a GPU, side by side in one process.

A graph pass (`hf_mars/decoding/graph.py`) has fixed shapes: it costs the same whatever it accepts, so a model of the
shipped checkpoint's shape with random weights times it exactly, with no checkpoint to carry. Tokens per forward are
the real checkpoint's business (docs/benchmarks.md); a method's speed-up over plain decoding is its tokens per
forward times `plain step / pass` printed here.

Every generation decodes `--new-tokens` tokens with no EOS, so each method does a known number of passes; each method
runs once to compile and capture before it is timed, and the methods take turns in each repeat (medians). A sampled
method (T = 0.7, top-k 50) is compared with sampled plain decoding, a greedy one with greedy plain decoding.
`--profile N` then runs each method once more under `torch.profiler` and prints where the device's time goes: its
busy time per pass (the kernels, inside CUDA graphs too) against the wall time, and the N kernels that take most.

    python examples/bench_graph_pass.py --device cuda --dtype bfloat16 --batch-sizes 1 8 --variants graph fused
    python examples/bench_graph_pass.py --variants graph fused --methods "τ = 1" "lossless 3x2,2" --profile 10
    python examples/bench_graph_pass.py --batch-sizes 1 --methods "τ = 1" "lossless 3x2,2" --variants graph --short 32

`--short N` also times every method for N new tokens, and splits a run's time into what one more pass costs (the
slope between the two lengths) and what a run costs besides its passes. `--one-config` keeps inductor from timing
several configs of a kernel on its first run.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
from transformers import GenerationMixin

from hf_mars.convert import to_mars
from hf_mars.decoding import graph_state
from hf_mars.tools.checkpoints.toy import toy_model, toy_tokenizer
from hf_mars.tools.measure.decode import static_compiled

# SmolLM2-135M-Instruct's shape: the shipped checkpoint's base
SMOLLM2_135M = dict(  # with `toy_model`'s token ids
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
SAMPLED = dict(do_sample=True, temperature=0.7, top_k=50)
PLAIN = {"plain generate()": dict(do_sample=False), "plain generate(), sampled": SAMPLED}
METHODS = {  # τ = 0 in lossless mode: every pass feeds its whole draft tree (its cost is the same either way)
    "τ = 1": dict(mars_tau=1.0),
    "τ = 0.9": dict(mars_tau=0.9),
    "lossless chain, B = 4": dict(mars_verify=True, mars_tau=0.0),
    "lossless 4x3+8": dict(mars_verify=True, mars_tau=0.0, mars_block_size=4, mars_draft_candidates=3, mars_lookup=8),
    "lossless 3x3+5": dict(mars_verify=True, mars_tau=0.0, mars_block_size=3, mars_draft_candidates=3, mars_lookup=5),
    "lossless 3x2,2": dict(mars_verify=True, mars_tau=0.0, mars_block_size=3, mars_draft_candidates=(2, 2)),
    "sampled τ = 0.9": dict(mars_tau=0.9, **SAMPLED),
    "sampled lossless 3x2,2": dict(
        mars_verify=True, mars_tau=0.0, mars_block_size=3, mars_draft_candidates=(2, 2), **SAMPLED
    ),
}
TREES = [(4, 3, 8), (3, 3, 5), (3, (2, 2), 0)]
VARIANTS = {
    "graph": "the whole pass as one graph (`graph.py`): its forward compiled, the pass around it captured",
    "fused": "the same pass compiled whole by inductor (bookkeeping fused with the forward), then captured",
}


def shipped_shape_model(device: str, dtype: torch.dtype, layers: int):
    """A random Llama of the shipped checkpoint's shape (`layers` deep), made MARS with B = 4."""
    tokenizer = toy_tokenizer()
    model = toy_model("llama", **{**SMOLLM2_135M, "num_hidden_layers": layers}).to(device, dtype)
    return to_mars(model, tokenizer, block_size=4), tokenizer


def variant(name: str) -> None:
    """Switch `generate()` to a variant of the graph pass: its forward compiled, or the whole pass (`FUSED`).
    Passes of each variant are built and kept apart."""
    graph_state.FUSED = name == "fused"


def only_sdpa_backend(name: str) -> None:
    """Let SDPA take one kernel, every method plain decoding included. A compiled graph keeps the kernel it was traced
    with, and torch's compile caches on disk would hand back one traced before: they are turned off."""
    torch._inductor.config.force_disable_caches = True
    torch._functorch.config.enable_autograd_cache = False
    switches = {"flash": "enable_flash_sdp", "efficient": "enable_mem_efficient_sdp", "cudnn": "enable_cudnn_sdp"}
    for backend, switch in {**switches, "math": "enable_math_sdp"}.items():
        getattr(torch.backends.cuda, switch)(backend == name)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_calls(calls: dict, repeats: int, device: str) -> dict:
    """Median seconds and forward passes of each call (already warmed up), the calls taking turns."""
    seconds, passes = {name: [] for name in calls}, {}
    for _ in range(repeats):
        for name, (switch, call) in calls.items():
            switch()
            sync(device)
            start = time.perf_counter()
            out = call()
            sync(device)
            seconds[name].append(time.perf_counter() - start)
            stats = getattr(out, "mars_stats", None)
            passes[name] = stats.forward_passes if stats is not None else None
    return {name: (statistics.median(s), passes[name]) for name, s in seconds.items()}


def profile_calls(calls: dict, timed: dict, new_tokens: int, top: int, device: str) -> None:
    """Each call once under `torch.profiler`: device busy time and kernels per pass, and the `top` costliest ones."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
    print("\n| method | wall ms per pass | device busy ms per pass | kernels per pass |\n| --- | --- | --- | --- |")
    tables = {}
    for label, (switch, call) in calls.items():
        switch()
        sync(device)
        with profile(activities=[activity]) as prof:
            call()
            sync(device)
        seconds, passes = timed[label]
        passes = passes or new_tokens
        kernels = [e for e in prof.key_averages() if e.device_type.name == activity.name and e.self_device_time_total]
        if device != "cuda":  # on a CPU, its operators stand for kernels
            kernels = [e for e in prof.key_averages() if e.key.startswith("aten::")]
        busy = sum(_self_ms(e, device) for e in kernels)
        count = sum(e.count for e in kernels)
        print(f"| {label} | {1000 * seconds / passes:.2f} | {busy / passes:.2f} | {count / passes:.0f} |", flush=True)
        tables[label] = (sorted(kernels, key=lambda e: -_self_ms(e, device)), passes)
    per_pass = {}  # by method: {kernel: (ms, calls) per pass}
    for label, (kernels, passes) in tables.items():
        print(f"\n{label}: the {top} costliest kernels, ms per pass (calls per pass)")
        per_pass[label] = {e.key: (_self_ms(e, device) / passes, e.count / passes) for e in kernels}
        for e in kernels[:top]:
            print(f"  {_self_ms(e, device) / passes:7.3f}  ({e.count / passes:5.1f})  {e.key[:110]}")
    print_extra_kernels(per_pass, top)


def _self_ms(event, device: str) -> float:
    return (event.self_device_time_total if device == "cuda" else event.self_cpu_time_total) / 1000


def print_extra_kernels(per_pass: dict, top: int) -> None:
    """For each MARS method after the first, the `top` kernels whose calls per pass differ most from the first
    method's: where a wide pass's extra launches come from."""
    methods = [label for label in per_pass if label not in PLAIN]
    for label in methods[1:]:
        base, this = per_pass[methods[0]], per_pass[label]
        none = (0.0, 0.0)
        extra = {k: tuple(a - b for a, b in zip(this.get(k, none), base.get(k, none))) for k in {*base, *this}}
        extra = sorted(((k, d) for k, d in extra.items() if abs(d[1]) >= 0.5), key=lambda item: -abs(item[1][1]))
        print(f"\n{label} against {methods[0]}: calls per pass that differ, ms per pass (calls per pass)")
        for key, (ms, calls) in extra[:top]:
            print(f"  {ms:+7.3f}  ({calls:+6.1f})  {key[:110]}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--variants", nargs="+", default=["graph"], choices=list(VARIANTS))
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=SMOLLM2_135M["num_hidden_layers"], help="fewer: a quick check")
    parser.add_argument("--eager", action="store_true", help="a static cache without compiling (a quick check)")
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"], help="the model's attention")
    parser.add_argument(
        "--sdpa-backend",
        choices=["flash", "efficient", "cudnn", "math"],
        help="allow SDPA this kernel alone (CUDA), with torch's compile caches off so that it is traced anew",
    )
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="then profile each method: N kernels")
    parser.add_argument(
        "--short",
        type=int,
        default=0,
        metavar="N",
        help="also time each method for N new tokens (the same cache): a run's cost split into a fixed part (the "
        "prompt's pass, setting up, handing back) and a steady cost per pass",
    )
    parser.add_argument(
        "--one-config",
        action="store_true",
        help="inductor runs each pointwise kernel with its first config instead of timing several on its first run "
        "(which runs a kernel that writes its own inputs several times)",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch._dynamo.config.cache_size_limit = 64  # one graph per method, width and batch size
    torch._inductor.config.triton.autotune_pointwise = not args.one_config
    model, tokenizer = shipped_shape_model(args.device, getattr(torch, args.dtype), args.layers)
    model.set_attn_implementation(args.attention)
    if args.sdpa_backend:
        only_sdpa_backend(args.sdpa_backend)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    attention = args.attention + (f" ({args.sdpa_backend} kernel)" if args.sdpa_backend else "")
    setting = f"{args.dtype}, {attention} attention, {args.new_tokens} new tokens, no EOS"
    print(f"{device_name}, torch {torch.__version__}, {setting}", flush=True)
    for batch in args.batch_sizes:
        bench_batch(model, tokenizer, batch, args)


def bench_batch(model, tokenizer, batch: int, args) -> None:
    """Every method at one batch size: warmed up, timed taking turns, printed against the plain step (and, with
    `--short`, split into a fixed cost a run and a steady cost a pass; with `--profile`, profiled)."""
    enc = tokenizer(["hello world, how are you today"] * batch, return_tensors="pt").to(args.device)
    extra = static_compiled(model, enc.input_ids.shape[1], args.new_tokens, args.batch_sizes, TREES)
    if args.eager:
        extra.pop("compile_config", None)
    calls = method_calls(model, dict(**enc, max_new_tokens=args.new_tokens, eos_token_id=None, **extra), args)
    short = {f"{label} ({args.short} tokens)": call for label, call in shortened(calls, args.short).items()}
    with torch.no_grad():
        for label, (switch, call) in {**calls, **short}.items():  # warm-up: compile, capture
            start = time.perf_counter()
            switch()
            call()
            sync(args.device)
            print(f"  warm-up batch {batch}: {label} {time.perf_counter() - start:.1f} s", flush=True)
        timed = time_calls({**calls, **short}, args.repeats, args.device)
    steps = {name: timed[name][0] / args.new_tokens for name in calls if name in PLAIN}
    print(f"\nbatch {batch}: plain step " + ", ".join(f"{n} {1000 * s:.2f} ms" for n, s in steps.items()))
    print("| method | ms per pass | pass / plain step of the same decoding |\n| --- | --- | --- |")
    for label in calls:
        seconds, passes = timed[label]
        per_pass = seconds / (passes or args.new_tokens)
        step = steps[list(PLAIN)[int("sampled" in label)]]
        print(f"| {label} | {1000 * per_pass:.2f} | {per_pass / step:.2f}x |", flush=True)
    if args.short:
        print_steady(calls, timed, short, args)
    if args.profile:
        with torch.no_grad():
            profile_calls(calls, timed, args.new_tokens, args.profile, args.device)


def method_calls(model, common: dict, args) -> dict:
    """`{label: (switch to its variant, the call)}`: plain `generate()` (sampled too where a method samples), then
    each method in each variant."""
    sampled = any(METHODS[m].get("do_sample") for m in args.methods)
    plain = functools.partial(GenerationMixin.generate, model, **common)
    calls = {
        name: (functools.partial(variant, "graph"), functools.partial(plain, **kw))
        for name, kw in PLAIN.items()
        if sampled or not kw["do_sample"]
    }
    for method in args.methods:
        call = functools.partial(
            model.generate, **common, return_dict_in_generate=True, **{"do_sample": False, **METHODS[method]}
        )
        for name in args.variants:
            calls[f"{method}, {name}"] = (functools.partial(variant, name), call)
    return calls


def shortened(calls: dict, new_tokens: int) -> dict:
    """The same calls for `new_tokens` new tokens (none where 0): the cache keeps its size, so nothing recompiles."""
    if not new_tokens:
        return {}
    return {
        label: (switch, functools.partial(call, max_new_tokens=new_tokens)) for label, (switch, call) in calls.items()
    }


def split_run(long: tuple[float, int], short: tuple[float, int]) -> tuple[float, float]:
    """`(fixed, steady)` seconds of a run from two runs of it, `(seconds, passes)` each: the steady cost of one more
    pass is the slope between them, the fixed cost what the longer run took besides its passes."""
    (seconds, passes), (short_seconds, short_passes) = long, short
    steady = (seconds - short_seconds) / max(passes - short_passes, 1)
    return seconds - steady * passes, steady


def print_steady(calls: dict, timed: dict, short: dict, args) -> None:
    """Each method's run split by the two lengths timed: the steady cost of one more pass (the slope between them)
    and what a run costs besides its passes (the prompt's forward, setting up, handing back), against plain's."""
    print("\n| method | fixed ms a run | steady ms a pass | steady pass / plain step |\n| --- | --- | --- | --- |")
    costs = {}
    for label, short_label in zip(calls, short):
        (seconds, passes), (short_seconds, short_passes) = timed[label], timed[short_label]
        costs[label] = split_run((seconds, passes or args.new_tokens), (short_seconds, short_passes or args.short))
    for label, (fixed, steady) in costs.items():
        step = costs[list(PLAIN)[int("sampled" in label)]][1]
        print(f"| {label} | {1000 * fixed:.2f} | {1000 * steady:.2f} | {steady / step:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
