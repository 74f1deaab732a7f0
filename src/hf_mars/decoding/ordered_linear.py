"""Linear layers whose row count does not change a row: the other half of the `ordered` implementation.

`ordered` attention (`ordered_attention.py`) gives a query the same bits whatever else a pass holds; a token's logits
are then the same in a wide pass as in a one-token step only if the linear layers give a row the same bits whatever
rows sit beside it. Matrix libraries choose their kernel and how they split the work by the number of rows: on the
CPUs tried, a float32 product takes another kernel for one row than for several, and another again where a thread's
share of rows is short. So every product here has one shape: blocks of exactly `ROWS` rows (the last one padded with
zeros, cut off after), each computed as `weight @ block.T`, the form whose kernel reads the weight once per block and
costs least at a few rows.

Whether a machine needs it is found, not assumed: `rows_invariant` tries each weight shape and dtype once, on random
numbers, at a few row counts, and a layer takes blocks only where plain products are not row-invariant (bfloat16 ones
on these CPUs are, so they run as they are and cost nothing more). The MARS classes (`modeling.py`) turn this on and
off with the attention: `attn_implementation="ordered"` orders both.

This file is copied into MARS checkpoints (trust_remote_code).
"""

from __future__ import annotations

import torch

ROWS = 16  # every blocked product has this many rows: a one-token step's and a wide pass's rows take one kernel
PROBE_ROWS = (1, 2, 3, 5, 8, 13, 24)  # row counts tried: one row, short shares, full tiles, a remainder
_invariant: dict[tuple, bool] = {}


class OrderedLinear(torch.nn.Linear):
    """`nn.Linear` that computes its rows in blocks of `ROWS` where this machine's products round a row by the rows
    beside it. The same parameters and state dict as `nn.Linear`; `order_linears` swaps a layer's class in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if rows_invariant(self.weight):
            return torch.nn.functional.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, x.shape[-1])
        rows = flat.shape[0]
        padded = torch.nn.functional.pad(flat, (0, 0, 0, -rows % ROWS))
        out = torch.cat([torch.mm(self.weight, block.t()).t() for block in padded.split(ROWS)])[:rows]
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], -1)


def rows_invariant(weight: torch.Tensor) -> bool:
    """Whether plain products with a weight of this shape, dtype and device give each row the bits it gets alone, at
    every row count of `PROBE_ROWS` (tried once, on random numbers)."""
    key = (weight.dtype, weight.device, tuple(weight.shape))
    if key not in _invariant:
        numbers = torch.Generator(device=weight.device).manual_seed(0)
        w = torch.randn(weight.shape, generator=numbers, device=weight.device).to(weight.dtype)
        x = torch.randn(max(PROBE_ROWS), weight.shape[1], generator=numbers, device=weight.device).to(weight.dtype)
        with torch.no_grad():
            alone = torch.cat([torch.nn.functional.linear(x[i : i + 1], w) for i in range(len(x))])
            _invariant[key] = all(torch.equal(torch.nn.functional.linear(x[:n], w), alone[:n]) for n in PROBE_ROWS)
    return _invariant[key]


def order_linears(model: torch.nn.Module, on: bool = True) -> None:
    """Make every `nn.Linear` of `model` an `OrderedLinear` (or back, with `on=False`), in place: the same
    parameters, hooks and state dict. Subclasses of `nn.Linear` (quantized layers, adapters) are left as they are."""
    for module in model.modules():
        if on and type(module) is torch.nn.Linear:
            module.__class__ = OrderedLinear
        elif not on and type(module) is OrderedLinear:
            module.__class__ = torch.nn.Linear
