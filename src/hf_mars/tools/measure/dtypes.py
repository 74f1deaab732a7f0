"""Which dtype to decode in: the one where lossless decoding is expected fastest on this machine.

Plain bfloat16 decoding is faster than float32 on most CPUs (half the bytes to read), but a wide bfloat16 pass is
cheap only where the CPU computes bfloat16 natively (AVX512-BF16, AMX) or on a GPU; elsewhere it is emulated, and a
draft tree can lose what the dtype gained, as can the prompt's forward, the widest pass of all. So the choice is made
from the same pass costs, per dtype (timed here: `passes.py`), the prompt's cost and the checkpoint's
`mars_acceptance`, for a call of a given prompt length and number of new tokens. Where the machine is too busy to
time, from what is known of this kind of device (`costs.prior_costs`), for every dtype alike.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ...decoding.costs import (
    MARGIN,
    NotMeasured,
    best_rate,
    check_acceptance,
    device_kind,
    parse_tree,
    pass_width,
    pay_limit,
    prior_costs,
    tree_key,
)
from .passes import pass_costs

PROMPT_TOKENS, NEW_TOKENS = 256, 256  # the call `choose_dtype` plans for when it is not told


@dataclass
class DtypeChoice:
    dtype: torch.dtype
    plain: dict[torch.dtype, float]  # expected tokens/s per row of plain decoding, prompt included, by dtype
    lossless: dict[torch.dtype, tuple[tuple | None, float]]  # ((B, N, L) or None, tokens/s per row), by dtype
    prefill: dict[torch.dtype, float]  # expected seconds of the prompt's forward, by dtype
    prompt_tokens: int = PROMPT_TOKENS
    new_tokens: int = NEW_TOKENS
    prior: str | None = None  # the kind of device whose known costs chose (`costs.prior_costs`); None: timed here

    @property
    def fastest_plain(self) -> torch.dtype:
        return max(self.plain, key=self.plain.get)

    def reason(self) -> str:
        """One line: what was chosen, and the expected rates that chose it (from a prior: relative to plain
        float32, since no second was timed)."""
        unit = self.plain.get(torch.float32, 1.0) if self.prior else 1.0

        def rate(dtype):
            tree, tokens = self.lossless[dtype]
            how = f"tree {tree_key(*tree)}" if tree else "plain, no tree pays"
            if self.prior:
                return f"{_name(dtype)} {tokens / unit:.2f}x ({how})"
            plain, prompt = self.plain[dtype], self.prefill[dtype]
            return f"{_name(dtype)} {tokens:.1f} tokens/s ({how}; plain {plain:.1f}; prompt {prompt:.1f} s)"

        call = f"{self.prompt_tokens}-token prompt, {self.new_tokens} new tokens"
        if self.prior:
            return (
                f"dtype {_name(self.dtype)}, from what is known of {self.prior} (this machine's pass costs not "
                f"timed): expected lossless for a {call}, against plain float32: "
                + ", ".join(map(rate, self.lossless))
            )
        return f"dtype {_name(self.dtype)}: expected lossless for a {call}: " + ", ".join(map(rate, self.lossless))


def candidate_dtypes(model) -> list[torch.dtype]:
    """float32, and bfloat16 where the device runs it at all: every CPU torch runs on, a GPU that supports it."""
    if model.device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return [torch.float32]
    return [torch.float32, torch.bfloat16]


def choose_dtype(
    model, batch_size: int = 1, prompt_tokens: int = PROMPT_TOKENS, new_tokens: int = NEW_TOKENS
) -> DtypeChoice:
    """The dtype of the highest expected lossless tokens per second at `batch_size` for a call that reads a
    `prompt_tokens`-long prompt and writes `new_tokens` (a plain one-token pass where the checkpoint has no
    `mars_acceptance`): the prompt's forward, then the steps. Costs seconds per dtype the first time on a machine
    (none on a busy one, which `prior_costs` stands for)."""
    acceptance = getattr(model.generation_config, "mars_acceptance", None)
    acceptance = check_acceptance(acceptance) if acceptance else {}
    widths = [pass_width(*parse_tree(name)) for name in acceptance]
    limit = pay_limit(acceptance) if acceptance else None
    copies = {dtype: in_dtype(model, dtype) for dtype in candidate_dtypes(model)}
    try:  # a busy machine declines: then every dtype from what is known, in the same units
        found = {d: pass_costs(m, batch_size, widths, limit=limit, prefill=True) for d, m in copies.items()}
        prior = None
    except NotMeasured:
        found = {d: prior_costs(m, batch_size, widths) for d, m in copies.items()}
        prior = " and ".join(sorted({device_kind(m) for m in copies.values()}))
    plain, lossless, prefill = {}, {}, {}
    for dtype, costs in found.items():
        prefill[dtype] = seconds = costs.prefill * prompt_tokens
        tree, rate = best_rate(acceptance, costs)
        plain[dtype] = new_tokens / (seconds + new_tokens / costs.plain_rate())
        lossless[dtype] = (tree, new_tokens / (seconds + new_tokens / rate))
    # A tree's rate rests on tokens per forward measured on other prompts: across dtypes, as within one
    # (`costs.choose_tree`), it must beat plain decoding by the margin
    best = max(lossless, key=lambda d: lossless[d][1] / (MARGIN if lossless[d][0] else 1.0))
    return DtypeChoice(best, plain, lossless, prefill, prompt_tokens, new_tokens, prior)


def in_dtype(model, dtype: torch.dtype):
    """`model` in `dtype`: itself if it is, else a converted copy (the original stays as it is)."""
    return model if model.dtype == dtype else copy.deepcopy(model).to(dtype)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
