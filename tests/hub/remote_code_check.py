"""Decode with a saved MARS checkpoint where hf_mars is not installed, as a checkpoint's user does: the script that
`test_transformers_range.py` runs under each end of the supported transformers range.

    python remote_code_check.py CHECKPOINT INPUTS.json

It loads CHECKPOINT with `trust_remote_code=True` and its tokenizer, then checks: the tokenizer encodes as where it
was saved, with `<|mask|>`; the model uses the saved RoPE base; in float32 on a left-padded batch, τ = 1 and lossless
mode (chain, tree, static cache) give plain greedy `generate()`'s tokens; τ-mode's passes after the prompt's run in
the runner's graph pass, and its batch equals its rows decoded alone; the cache is returned; a user's static cache
too small for MARS is refused. It prints one line per check and exits 1 on the first failure. It imports only the
standard library, torch and transformers.
"""

from __future__ import annotations

import json
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationMixin, StaticCache
from transformers.generation.utils import GenerateDecoderOnlyOutput


def main(checkpoint: str, inputs: str) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True, torch_dtype=torch.float32)
    assert type(model).__name__.startswith("MARS"), type(model)
    given = json.loads(open(inputs).read())
    theta, prompts = given.pop("rope_theta"), given.pop("prompts")
    batch = {k: torch.tensor(v) for k, v in given.items()}
    new = dict(max_new_tokens=16, eos_token_id=None, pad_token_id=0)
    greedy = GenerationMixin.generate(model, **batch, do_sample=False, **new)
    print(f"transformers {transformers.__version__}: loaded {type(model).__name__}")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    mask_id = tokenizer.convert_tokens_to_ids("<|mask|>")
    check(mask_id == model.config.mars_mask_token_id, f"the tokenizer loads, <|mask|> = {mask_id}")
    ids = tokenizer(prompts, return_tensors="pt", padding=True).input_ids
    check(torch.equal(ids, batch["input_ids"]), "the tokenizer encodes as where it was saved")
    inverse = model.model.rotary_emb.inv_freq.double()  # 1 / base ** (2i / dim): the base the model really uses
    base = float((1 / inverse[1]) ** (len(inverse)))
    check(abs(base / theta - 1) < 1e-6, f"RoPE base {theta} read (the model uses {base:.6g})")
    for mode in (
        dict(mars_tau=1.0),
        dict(mars_verify=True),
        dict(mars_verify=True, mars_draft_candidates=3, mars_lookup=2),
        dict(mars_verify=True, cache_implementation="static"),
        dict(mars_tau=1.0, cache_implementation="static"),
    ):
        out = model.generate(**batch, **mode, **new)
        check(torch.equal(out, greedy), f"{mode}: greedy generate()'s tokens")
    callers = []
    hook = model.register_forward_pre_hook(lambda module, args: callers.append(pass_caller()))
    out = model.generate(**batch, mars_tau=0.6, return_dict_in_generate=True, **new)
    hook.remove()
    ran = set(callers[1:]) == {"graph.py:_forward"} and callers[0] == "session.py:_forward"
    check(
        ran and len(callers) == out.mars_stats.forward_passes, "τ = 0.6: every pass after the prompt's in the runner"
    )
    for row in range(batch["input_ids"].shape[0]):
        real = batch["attention_mask"][row].bool()
        alone = model.generate(input_ids=batch["input_ids"][row : row + 1, real], mars_tau=0.6, **new)
        check(torch.equal(alone[0, real.sum() :], out.sequences[row, real.numel() :]), f"τ = 0.6: row {row} alone")
    cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
    check(cache is not None and cache.get_seq_length() > 0, "τ = 0.6: the cache is returned")
    check(out.mars_stats.forward_passes > 0, "mars_stats")
    small = StaticCache(config=model.config, max_cache_len=20)  # a user's cache, too small for MARS: refused
    name = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
    try:
        model.generate(**batch, mars_verify=True, **{name: small}, **new)
        refused = False
    except ValueError as error:
        refused = "StaticCache of at least" in str(error)
    check(refused, "a user's StaticCache too small for MARS is refused, not replaced")


def pass_caller() -> str:
    """`file:function` of the innermost frame of the checkpoint's decoding code that ran a forward."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/").rsplit("/", 1)[-1]
        if name in ("graph.py", "session.py") and "transformers_modules" in frame.f_code.co_filename:
            return f"{name}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "elsewhere"


def check(ok: bool, what: str) -> None:
    print(("ok    " if ok else "FAILED ") + what, flush=True)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main(*sys.argv[1:])
