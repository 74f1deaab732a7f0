"""Calibration: what masks add to the time of a pass on this machine (`mars_mask_cost`), measured, and resolved for a
call (`mars_mask_cost="auto"`)."""

from __future__ import annotations

from ...decoding.costs import mask_shares
from ...decoding.generate import mars_settings
from .passes import measure_pass_costs


def auto_mask_cost(model, batch_size: int = 1, measured: list[float] | None = None, **mars_kwargs) -> list[float]:
    """`mars_mask_cost="auto"` resolved for a call with these `mars_*` kwargs: the cost of 1 .. B-1 masks measured
    on this machine (`measured`, else `measure_mask_cost` now) for the model's own B, cut to the B this call runs
    with, which may be smaller."""
    costs = measured if measured is not None else measure_mask_cost(model, batch_size)
    kwargs = {key: value for key, value in mars_kwargs.items() if key != "mars_mask_cost"}
    return costs[: mars_settings(model, None, batch_size, **kwargs)["mars_block_size"] - 1]


def measure_mask_cost(model, batch_size: int = 1, context: int = 256, repeats: int = 7) -> list[float]:
    """What masks add to the time of a decoding pass on this model and machine: `mars_mask_cost` as a list.

    For k = 1 .. B-1 masks (B = the model's block size), `t(k+1) / t(1) - 1`, where t(w) is the time of a pass over
    w tokens (`passes.measure_pass_costs`, the measurement `mars_lossless="auto"` chooses trees by). Measured, not
    assumed: it depends on the dtype's matrix kernels (a pass over a few rows may cost as much as over eight, or a pass
    over 2 tokens more than over 4) and so differs between machines.
    """
    block = int(model.config.mars_block_size)
    return mask_shares(measure_pass_costs(model, batch_size, range(1, block + 1), context, repeats), block)
