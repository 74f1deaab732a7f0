"""What a MARS `generate()` call runs with: `MARSSettings`, resolved once from its kwargs and the generation config.

Every `mars_*` argument not given falls back to the generation config's key of the same name, then to a built-in
default. Lossless mode reads `generation_config.mars_lossless` first: the fastest draft tree depends on the machine
and the batch size (`hf-mars tune` measures it and saves it there) and is not τ-mode's B.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

CONFIDENCE_MEASURES = ("probability", "entropy", "margin")
# Lossless mode's own defaults, read from `generation_config.mars_lossless`
LOSSLESS_KEYS = ("mars_tau", "mars_block_size", "mars_draft_candidates", "mars_lookup", "mars_mask_cost")


class TauController:
    """A τ that may change while a generation runs: pass it as `mars_tau` and set `.tau` from anywhere.

    The decoder reads it before every pass, so a slider in a UI or a load policy in a server changes the
    speed/quality trade-off of generations already in flight.
    """

    def __init__(self, tau: float = 1.0):
        self.tau = check_tau(tau)

    def __call__(self) -> float:
        return self.tau

    def __repr__(self) -> str:
        return f"TauController(tau={self.tau})"


def check_tau(tau) -> float:
    """Validate τ: a number in [0, 1]. 1 means plain autoregressive decoding; lower accepts more tokens per pass."""
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 <= float(tau) <= 1.0:
        raise ValueError(f"mars_tau must be a number in [0, 1] (1 = plain autoregressive decoding), got {tau!r}")
    return float(tau)


def read_tau(tau) -> float:
    """The current value of `mars_tau`: a number, or a callable (e.g. `TauController`) read at every pass."""
    return check_tau(tau() if callable(tau) else tau)


@dataclass(frozen=True)
class MARSSettings:
    """The validated MARS arguments of one `generate()` call (see `MARSGenerationMixin.generate` for each)."""

    tau: float | Callable[[], float]
    block_size: int
    mask_token_id: int
    confidence: str = "probability"
    verify: bool = False
    draft_candidates: int = 1
    lookup: int = 0
    mask_cost: float | tuple[float, ...] = 0.0

    def __post_init__(self):
        if not callable(self.tau):
            check_tau(self.tau)
        _check_count("mars_block_size", self.block_size, 1)
        if self.confidence not in CONFIDENCE_MEASURES:
            raise ValueError(f"mars_confidence must be one of {CONFIDENCE_MEASURES}, got {self.confidence!r}")
        _check_count("mars_draft_candidates", self.draft_candidates, 1)
        _check_count("mars_lookup", self.lookup, 0)
        if self.lookup and not self.verify:
            raise ValueError("mars_lookup drafts tokens for lossless mode: it needs mars_verify=True.")
        _check_mask_cost(self.mask_cost, self.block_size)

    @property
    def drafts_per_pass(self) -> int:
        """The most drafts a pass verifies (lossless mode) or masks it may accept (τ-mode)."""
        masks = self.block_size - 1
        return masks + self.draft_candidates - 1 + self.lookup if self.verify else masks

    def as_kwargs(self) -> dict:
        """The `generate()` keyword arguments these settings stand for (`mars_tau=...`, ...)."""
        kwargs = {f"mars_{name}": value for name, value in asdict(self).items()}
        cost = kwargs["mars_mask_cost"]
        kwargs["mars_mask_cost"] = list(cost) if isinstance(cost, tuple) else cost
        return kwargs


def resolve_settings(model, generation_config=None, batch_size: int = 1, **kwargs) -> MARSSettings | None:
    """`MARSSettings` for these `mars_*` kwargs at this batch size; `None` means plain `generate()` (no τ anywhere).

    Lossless mode's output does not depend on τ, so it runs without one (τ = 0: every draft is proposed, the tree's
    shape bounds the pass).
    """
    base = generation_config if generation_config is not None else model.generation_config
    verify = bool(kwargs.get("mars_verify"))
    preset = lossless_preset(base, batch_size) if verify else {}

    def setting(name, default=None):
        return _first_set(kwargs.get(name), preset.get(name), getattr(base, name, None), default)

    tau = setting("mars_tau", 0.0 if verify else None)
    if tau is None:
        return None
    mask_token_id = getattr(model.config, "mars_mask_token_id", None)
    if mask_token_id is None:
        raise ValueError(
            "This model has no `<|mask|>` token id (config.mars_mask_token_id); convert it with "
            "`hf_mars.to_mars(model, tokenizer)` before decoding with `mars_tau`."
        )
    cost = setting("mars_mask_cost", 0.0)
    return MARSSettings(
        tau=tau,
        block_size=setting("mars_block_size", getattr(model.config, "mars_block_size", None)),
        mask_token_id=mask_token_id,
        confidence=setting("mars_confidence", "probability"),
        verify=verify,
        draft_candidates=setting("mars_draft_candidates", 1),
        lookup=setting("mars_lookup", 0),
        mask_cost=tuple(cost) if isinstance(cost, list) else cost,
    )


def mars_settings(model, generation_config=None, batch_size: int = 1, **kwargs) -> dict | None:
    """What `generate(**kwargs)` runs with at this batch size, as `generate()` kwargs with every default resolved;
    `None`: plain `generate()`. See `resolve_settings`."""
    settings = resolve_settings(model, generation_config, batch_size, **kwargs)
    return None if settings is None else settings.as_kwargs()


def lossless_preset(generation_config, batch_size: int = 1) -> dict:
    """`generation_config.mars_lossless` for this batch size, checked; {} when there is none.

    It is a dict over `LOSSLESS_KEYS`, or such dicts by batch size (`{"1": {...}, "4": {...}}`): a batch uses the
    entry of the largest size it reaches, else the smallest.
    """
    preset = getattr(generation_config, "mars_lossless", None) or {}
    if isinstance(preset, dict) and preset and all(isinstance(k, str) and k.isdigit() for k in preset):
        sizes = sorted(int(k) for k in preset)
        preset = preset[str(max([n for n in sizes if n <= batch_size] or sizes[:1]))]
    if not isinstance(preset, dict) or not set(preset) <= set(LOSSLESS_KEYS):
        raise ValueError(
            f"generation_config.mars_lossless must be a dict over {LOSSLESS_KEYS} (or such dicts by batch size), "
            f"got {getattr(generation_config, 'mars_lossless', None)!r}"
        )
    return preset


def _check_count(name: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def _check_mask_cost(cost, block_size: int) -> None:
    costs = list(cost) if isinstance(cost, (list, tuple)) else [cost]
    if isinstance(cost, (list, tuple)) and len(costs) != block_size - 1:
        raise ValueError(
            f"mars_mask_cost as a list needs one cost per mask count 1..B-1 ({block_size - 1}), got {list(costs)!r}"
        )
    if not all(not isinstance(c, bool) and isinstance(c, (int, float)) and 0 <= c < math.inf for c in costs):
        raise ValueError(
            f"mars_mask_cost must be a number >= 0 or a list of them (0 = B-1 masks every pass), got {cost!r}"
        )


def _first_set(*values):
    return next((v for v in values if v is not None), None)
