"""Decoding as the tools run it: plain greedy `generate()` (the reference) and MARS, each returning what the
benchmark and the evals count, the static-cache-and-compile settings a GPU server would use, and token counting.
"""

from __future__ import annotations

import torch
from transformers import CompileConfig, GenerationMixin

from ...decoding.costs import parse_tree


def generate_ar(model, **inputs):
    """Plain `generate()` of transformers (the reference), greedy unless `inputs` say `do_sample`: `(sequences,
    None)`."""
    return GenerationMixin.generate(model, **{"do_sample": False, **inputs}), None


def static_compiled(model, longest_prompt: int, max_new_tokens: int, batch_sizes, trees=()) -> dict:
    """`generate()` kwargs for a static cache and `generate()`'s compile path, for plain decoding and MARS alike.

    `max_cache_len` is the most slots any method here needs (τ-mode, the default lossless tree, `trees`), so every
    method's cache has one size and nothing recompiles for a longer prompt. Where the checkpoint has a
    `mars_acceptance` table, lossless mode's `"auto"` picks one of its trees: every one is sized for, so that none is
    timed here (and on the eager path, which is not the one that will run). On a GPU `generate()` compiles with its
    default `CompileConfig` (CUDA graphs); elsewhere it is told to compile all the same.
    """
    acceptance = getattr(model.generation_config, "mars_acceptance", None) or {}
    calls = [dict(mars_tau=0.5)] + ([] if acceptance else [dict(mars_verify=True)])
    calls += [
        dict(mars_verify=True, mars_block_size=b, mars_draft_candidates=n, mars_lookup=lookup)
        for b, n, lookup in [*trees, *map(parse_tree, acceptance)]
    ]
    slots = max(
        model.mars_cache_length(longest_prompt, max_new_tokens, batch, **call)
        for batch in batch_sizes
        for call in calls
    )
    return dict(compiled_path(model), max_cache_len=slots)


def compiled_path(model) -> dict:
    """`generate()` kwargs of its compile path with a static cache: on a GPU its default `CompileConfig` (CUDA
    graphs), elsewhere one that tells it to compile all the same."""
    kwargs = dict(cache_implementation="static")
    if model.device.type != "cuda":
        kwargs["compile_config"] = CompileConfig(mode="default")
        kwargs["compile_config"]._compile_all_devices = True  # generate()'s own switch for compiling off a GPU
    return kwargs


def generate_mars(model, tau, verify=False, mask_cost=0.0, block_size=None, candidates=None, lookup=None, **inputs):
    """MARS decoding, greedy unless `inputs` say `do_sample`: `(sequences, row_passes)`. `None`: the model's default
    (lossless: its `mars_lossless`)."""
    inputs = {"do_sample": False, **inputs}
    out = model.generate(
        mars_tau=tau,
        mars_verify=verify,
        mars_mask_cost=mask_cost,
        mars_block_size=block_size,
        mars_draft_candidates=candidates,
        mars_lookup=lookup,
        return_dict_in_generate=True,
        **inputs,
    )
    return out.sequences, int(out.mars_stats.passes_per_row.sum())


def eos_token_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    return [ids] if isinstance(ids, int) else list(ids or [tokenizer.eos_token_id])


def count_new_tokens(generated, tokenizer, eos_ids) -> int:
    """Generated tokens up to and including each row's first EOS (rows that stopped early are right-padded).

    Counting non-pad tokens instead would miss the EOS where it doubles as the pad token (SmolLM2, Qwen).
    """
    width = generated.shape[1]
    slot = torch.arange(width, device=generated.device)
    ends = (
        torch.isin(generated, torch.tensor(eos_ids, device=generated.device))
        if eos_ids
        else torch.zeros_like(generated, dtype=torch.bool)
    )
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id not in eos_ids:
        ends |= torch.cat(
            [generated[:, 1:] == tokenizer.pad_token_id, torch.zeros_like(generated[:, :1], dtype=torch.bool)], dim=1
        )
    # A row ends at its first EOS, or just before its right padding; rows with neither ran to max_new_tokens
    last = torch.where(ends, slot, width).min(dim=1).values
    return int(torch.clamp(last + 1, max=width).sum())
