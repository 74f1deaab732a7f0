"""Which dtype to decode in on this machine: the one where lossless decoding is expected fastest.

Plain bfloat16 decoding is faster than float32 on most CPUs (half the bytes to read), but a wide pass in bfloat16 is
cheap only where the CPU computes bfloat16 natively (AVX512-BF16, AMX) or on a GPU; elsewhere it is emulated and a
draft tree can lose what the dtype gained. So the choice is made from what a pass costs here, per dtype
(`decoding/costs.py`, measured once and cached), and the checkpoint's tokens per forward (`mars_acceptance`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..decoding.costs import best_rate, check_acceptance, parse_tree, pass_costs, pass_width, tree_key


@dataclass
class DtypeChoice:
    dtype: torch.dtype
    plain: dict[torch.dtype, float]  # expected tokens/s of plain decoding, by dtype (1 / a one-token pass)
    lossless: dict[torch.dtype, tuple[tuple[int, int, int] | None, float]]  # (tree or None, tokens/s), by dtype

    @property
    def fastest_plain(self) -> torch.dtype:
        return max(self.plain, key=self.plain.get)

    def reason(self) -> str:
        """One line: what was chosen, and the expected rates that chose it."""

        def rate(dtype):
            tree, tokens = self.lossless[dtype]
            how = f"tree {tree_key(*tree)}" if tree else "plain, no tree pays"
            return f"{_name(dtype)} {tokens:.0f} tokens/s ({how}; plain {self.plain[dtype]:.0f})"

        return f"dtype {_name(self.dtype)}: expected lossless " + ", ".join(rate(d) for d in self.lossless)


def candidate_dtypes(model) -> list[torch.dtype]:
    """float32, and bfloat16 where the device runs it at all: every CPU torch runs on, a GPU that supports it."""
    if model.device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return [torch.float32]
    return [torch.float32, torch.bfloat16]


def choose_dtype(model, batch_size: int = 1) -> DtypeChoice:
    """The dtype of the highest expected lossless tokens per second at `batch_size` (a plain one-token pass where
    the checkpoint has no `mars_acceptance`). Costs a few seconds per dtype the first time on a machine."""
    acceptance = getattr(model.generation_config, "mars_acceptance", None)
    acceptance = check_acceptance(acceptance) if acceptance else {}
    widths = [pass_width(*parse_tree(name)) for name in acceptance]
    plain, lossless = {}, {}
    for dtype in candidate_dtypes(model):
        copied = in_dtype(model, dtype)
        costs = pass_costs(copied, batch_size, widths)
        plain[dtype], lossless[dtype] = 1 / costs[1], best_rate(acceptance, costs)
        del copied
    return DtypeChoice(max(lossless, key=lambda d: lossless[d][1]), plain, lossless)


def in_dtype(model, dtype: torch.dtype):
    """`model` in `dtype`: itself if it is, else a converted copy (the original stays as it is)."""
    return model if model.dtype == dtype else copy.deepcopy(model).to(dtype)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
