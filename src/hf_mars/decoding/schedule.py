"""How many masks each row is offered in a pass: B-1 always (the paper), or only those worth their time.

A mask is a token the forward must process. Where a pass is bound by reading the weights (a GPU at small batch, a
CPU's bfloat16 kernels at batch 1) it is nearly free; where the kernels for a few rows are slow (float32 on CPU) or the
batch fills the compute, it is not. `mars_mask_cost` says what masks cost; `MaskSchedule` then offers each row the
masks whose expected accepted tokens pay for them.
"""

from __future__ import annotations

import functools

import torch

from .scoring import write_into

# EMA weight of each observed acceptance; pull of an unoffered mask's rate back toward 1 (every PROBE_EVERY-th pass
# of a row), which is how a row that stopped offering a mask tries it again.
RATE_START, RATE_STEP, RECOVER, PROBE_EVERY = 0.5, 0.25, 0.05, 8


class MaskSchedule:
    """How many masks each row is offered in a pass: B-1 always (cost 0, the paper), or those that pay (cost > 0).

    A mask is a token the forward must process. Where a pass is bound by reading the weights (a GPU at small batch,
    a CPU's bfloat16 kernels at batch 1) it is nearly free; where the kernels for a few rows are slow (float32 on
    CPU) or the batch fills the compute, it is not: `cost[k-1]` is what a pass with k masks takes beyond a one-token
    pass, as a share of it (a number c means `c * k`). Masks pay only when their predictions are accepted. With a
    cost, each row keeps `rate[j]`, a running estimate of how often mask j is accepted when masks < j were, and is
    offered the k masks that maximise expected tokens per unit of time, `(1 + R_0 + ... + R_{k-1}) / (1 + cost_k)`,
    `R_j = rate[0] * ... * rate[j]`.
    A mask a row is not offered drifts back toward "accepted" every few passes, so the row tries it again now and then.

    Everything a row's offer depends on is its own history (its past acceptances, its own pass count), so its tokens
    never depend on the rest of the batch: batched output equals unbatched. The batch feeds at least the largest offer
    (more where a wider pass is cheaper: CPU kernels can be), and a row ignores the masks past its own (under causal
    attention they cannot change what it sees). With τ >= 1 no mask is fed.
    """

    def __init__(self, cost, batch: int, most: int, device):
        self.most = most
        costs = [float(cost) * k for k in range(1, most + 1)] if isinstance(cost, (int, float)) else list(cost)
        self.constant = not any(costs)
        self.time = torch.tensor([1.0] + [1.0 + c for c in costs], dtype=torch.float64, device=device)  # k masks
        self.rate = torch.full((batch, most), RATE_START, dtype=torch.float64, device=device)
        self.last = torch.zeros(batch, dtype=torch.long, device=device)  # lossless: masks offered in the last pass
        self.moves = None if self.constant else rate_moves(most).to(device)

    def offer(self) -> torch.Tensor:
        """`(batch,)` masks each row may use in this pass."""
        if self.constant:
            return torch.full_like(self.last, self.most)
        return offers(torch.nn.functional.pad(self.rate, (1, 0), value=1.0), self.time)

    def update(self, offered: torch.Tensor, masks_used: torch.Tensor, passes: torch.Tensor) -> None:
        """The rows, in their `passes`-th pass, were offered `offered` masks and used the first `masks_used`."""
        if not self.constant:
            self.rate = rates_after(self.rate, offered, masks_used, passes, self.moves)


def offers(rates: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
    """`(rows,)` masks each row is offered: the count that maximises its expected tokens per unit of `time`, from
    its acceptance rate of each mask after a first column of ones (slot 0's token, always taken; a graph pass keeps
    its rates so, a prompt's pass pads them). Tensors alone, so that a prompt's pass and the graph pass share it."""
    reach = rates.cumprod(dim=1)  # 1 (slot 0), then R_j: mask j's tokens
    return reach.cumsum(dim=1).div_(time).argmax(dim=1)  # tokens with k masks; the first maximum: fewer masks


def masks_covering(offered: torch.Tensor, time: torch.Tensor) -> int:
    """The cheapest count of masks (`time[k]`: a pass with k masks) that covers the largest of these offers."""
    need = int(offered.max()) if offered.numel() else 0
    return need + int(time[need:].argmin())


@functools.lru_cache(maxsize=16)
def rate_moves(most: int) -> torch.Tensor:
    """`(PROBE_EVERY, most + 1, most + 1, 2, most)`: how one pass moves each mask's rate, as `rate * scale + shift`
    (`[..., 0, :]` the scale, `[..., 1, :]` the shift), by the row's passes modulo `PROBE_EVERY`, the masks it was
    offered and how many of them it used. A mask seen (offered, every mask before it used) moves `RATE_STEP` of the
    way toward what happened to it; one not offered drifts `RECOVER` of the way back toward "accepted" on a row's
    every `PROBE_EVERY`-th pass; the rest stay. A table, so that a pass reads its moves with one index (`rates_after`)
    rather than working the cases out in a dozen ops; made once per count, on the host (read it, never write it)."""
    phase, offered, masks_used, depth = torch.meshgrid(
        *(torch.arange(n) for n in (PROBE_EVERY, most + 1, most + 1, most)), indexing="ij"
    )
    seen = (depth < offered) & (depth <= masks_used)
    recover = (depth >= offered) & (phase == 0)
    one, zero = torch.ones((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    scale = torch.where(seen, 1 - RATE_STEP, torch.where(recover, 1 - RECOVER, one))
    shift = torch.where(seen, RATE_STEP * (depth < masks_used).double(), torch.where(recover, RECOVER, zero))
    return torch.stack([scale, shift], dim=3)


def rates_after(rate, offered, masks_used, passes, moves, out=None) -> torch.Tensor | None:
    """Each row's `rate` once a pass (its `passes`-th) offered it `offered` masks, of which the first `masks_used` were
    accepted (`moves`: `rate_moves`' table); written into `out` where given (`rate` itself: element by element)."""
    scale, shift = moves[passes % PROBE_EVERY, offered, masks_used].unbind(dim=1)
    if out is None:
        return torch.addcmul(shift, rate, scale)
    write_into(out, torch.addcmul, shift, rate, scale)
    return None
