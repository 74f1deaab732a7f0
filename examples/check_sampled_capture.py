"""Does a sampled MARS pass draw the same tokens captured as a CUDA graph as it draws op by op?

On CUDA, under `generate()`'s compile path, a graph pass is captured once and replayed; its random numbers then come
from the generator's state at each replay. With a seed, the captured pass must draw what the same pass run eagerly
(op by op, `disable_compile=True`) draws, in the same order, and a second run must repeat the first.
Prints the share of equal tokens per mode (float32 forwards compiled differently may, rarely, flip a draw).

    python examples/check_sampled_capture.py --device cuda
"""

from __future__ import annotations

import argparse

import torch

from hf_mars.convert import to_mars
from hf_mars.decoding import graph_state
from hf_mars.tools.checkpoints.toy import toy_model, toy_tokenizer

MODES = {
    "sampled τ = 0.9": dict(mars_tau=0.9),
    "sampled τ = 1": dict(mars_tau=1.0),
    "sampled lossless chain": dict(mars_verify=True, mars_tau=0.5),
}


def decode(model, enc, seed: int, captured: bool, **mode) -> torch.Tensor:
    """A static-cache run, every pass after the prompt's in the graph pass: under `generate()`'s compile path (on CUDA
    captured), or not `captured`, eagerly. The pass keeps its whole shape either way (`NARROWS` off: an eager
    pass on a CPU would feed, and draw for, only the drafts some row has)."""
    graph_state.NARROWS = False
    torch.manual_seed(seed)
    out = model.generate(**enc, max_new_tokens=64, do_sample=True, temperature=1.0, top_k=0, eos_token_id=None,
                         cache_implementation="static", disable_compile=not captured, **mode)  # fmt: skip
    graph_state.NARROWS = True
    return out[:, enc["input_ids"].shape[1] :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    tokenizer = toy_tokenizer()
    model = toy_model("llama", num_hidden_layers=args.layers, hidden_size=256, intermediate_size=512)
    model = to_mars(model.to(args.device), tokenizer, block_size=4)
    enc = tokenizer(["hello world", "how are you today, friend"], return_tensors="pt", padding=True).to(args.device)
    with torch.no_grad():
        for name, mode in MODES.items():
            captured = decode(model, enc, 0, True, **mode)
            again = decode(model, enc, 0, True, **mode)
            other_seed = decode(model, enc, 1, True, **mode)
            eager = decode(model, enc, 0, False, **mode)
            equal = (captured == eager).float().mean().item()
            print(f"{name}: captured = eager on {equal:.1%} of tokens; a second run repeats it: "
                  f"{torch.equal(captured, again)}; another seed differs: {not torch.equal(captured, other_seed)}; "
                  f"{len(torch.unique(captured))} distinct tokens", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
