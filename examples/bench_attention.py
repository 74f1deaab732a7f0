"""Which attention kernel a MARS pass should take on a GPU: SDPA's backends on the shapes of the shipped checkpoint.

A MARS pass feeds several queries (τ-mode: B pending tokens and B-1 masks; lossless mode: a whole draft tree) and
an additive 4D mask over the static cache, which SDPA serves with whichever kernel its dispatcher allows. Inside a
captured graph pass only the kernels' own time counts, so each backend is timed the way a pass runs it: `--layers`
calls captured in one CUDA graph and replayed. The queries and keys are what transformers' SDPA attention hands torch
when a mask is given (key and value heads repeated to the query heads). Each kernel's output is compared with the
math backend's in float32: the kernels differ only in how they round.

    python examples/bench_attention.py --batch-sizes 1 8 --widths 1 7 30 56 --slots 256 1024
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

DEVICE = "cuda"
HEADS, HEAD_DIM = 9, 64  # SmolLM2-135M: 9 query heads of 64 (3 key-value heads, repeated for SDPA with a mask)
BACKENDS = {
    "default": None,  # torch's own choice
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def inputs(batch: int, width: int, slots: int, dtype: torch.dtype):
    """Queries of a pass written at the middle of the cache, its keys and values, and a mask in the model's dtype that
    lets each query see the slots before the pass and a random half of the pass's own (itself always)."""
    q = torch.randn(batch, HEADS, width, HEAD_DIM, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(batch, HEADS, slots, HEAD_DIM, device=DEVICE, dtype=dtype) for _ in range(2))
    start = slots // 2
    seen = torch.zeros(batch, 1, width, slots, dtype=torch.bool, device=DEVICE)
    seen[..., :start] = True
    own = (torch.rand(batch, 1, width, width, device=DEVICE) < 0.5).tril()
    own |= torch.eye(width, dtype=torch.bool, device=DEVICE)
    seen[..., start : start + width] = own
    mask = torch.zeros(seen.shape, dtype=dtype, device=DEVICE).masked_fill_(~seen, torch.finfo(dtype).min)
    return q, k, v, mask


def attend(backend, q, k, v, mask):
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def replay_ms(call, layers: int, repeats: int) -> float:
    """Milliseconds per call, `layers` calls captured as one CUDA graph and replayed `repeats` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(layers):
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats / layers


def kernel_name(backend, q, k, v, mask) -> str:
    """The costliest device kernel one call launches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        attend(backend, q, k, v, mask)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total]
    return max(kernels, key=lambda e: e.self_device_time_total).key[:60] if kernels else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 7, 30, 56], help="queries a pass feeds")
    parser.add_argument("--slots", type=int, nargs="+", default=[256, 1024], help="static cache slots")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--compiled", action="store_true", help="also the math backend compiled by inductor (fused)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}")
    torch._dynamo.config.recompile_limit = 64  # the compiled math backend: one graph per shape at most
    compiled = torch.compile(functools.partial(attend, SDPBackend.MATH))
    backends = dict(BACKENDS) | ({"math, compiled": "compiled"} if args.compiled else {})
    print("| batch | slots | width | " + " | ".join(f"{name} µs" for name in backends) + " | default's kernel |")
    print("| --- " * (len(backends) + 4) + "|")
    for batch in args.batch_sizes:
        for slots in args.slots:
            for width in args.widths:
                cells, kernel = row(backends, compiled, inputs(batch, width, slots, dtype), args.layers, args.repeats)
                print(f"| {batch} | {slots} | {width} | " + " | ".join(cells) + f" | {kernel} |", flush=True)


def row(backends: dict, compiled, qkvm, layers: int, repeats: int) -> tuple[list[str], str]:
    """Each backend's µs per call and largest difference from the float32 math backend, and the default's kernel."""
    reference = attend(SDPBackend.MATH, *(t.float() for t in qkvm))
    cells = []
    for backend in backends.values():
        if backend == "compiled":
            call = functools.partial(compiled, *qkvm)
        else:
            call = functools.partial(attend, backend, *qkvm)
        try:
            error = (call().float() - reference).abs().max().item()
            cells.append(f"{1000 * replay_ms(call, layers, repeats):.1f} (±{error:.0e})")
        except RuntimeError as e:  # a backend that refuses these inputs
            cells.append(f"refused: {str(e).splitlines()[0][:40]}")
    return cells, kernel_name(None, *qkvm)


if __name__ == "__main__":
    main()
