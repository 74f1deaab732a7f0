"""What a MARS `generate()` call runs with: `MARSSettings`, resolved once from its kwargs and the generation configs.

Every `mars_*` setting is read the same way wherever it is held, with one precedence, as `generate()` reads its own
settings: the keyword argument, then the `generation_config=` passed to the call, then `model.generation_config`,
then a built-in default. In lossless mode each of the two configs is read through its `mars_lossless` preset first:
the fastest draft tree depends on the machine and the batch size (`hf-mars tune` measures it and saves it there) and
is not τ-mode's B. Values are checked strictly (`mars_verify` is a bool, not a truthy string), and a setting that
the chosen mode would ignore is refused, so that nothing a caller set is silently dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import SimpleNamespace

from transformers import CompileConfig

from .costs import (
    NotMeasured,
    check_acceptance,
    choose_tree,
    compiled_pass_costs,
    mask_costs,
    parse_tree,
    pass_costs,
    pass_width,
    pay_limit,
    prior_costs,
    warn_not_measured,
)
from .tree import runner_ups

CONFIDENCE_MEASURES = ("probability", "entropy", "margin")
# How lossless mode's pass keeps drafts: "exact" (the model's own output) or "typical" (Medusa's typical acceptance)
ACCEPT_RULES = ("exact", "typical")
# Typical acceptance keeps a draft whose verified probability is at least min(ε, δ·exp(-H)); Medusa's defaults
TYPICAL_EPSILON, TYPICAL_DELTA = 0.09, 0.3
# Lossless mode's own defaults, read from `generation_config.mars_lossless`
LOSSLESS_KEYS = ("mars_tau", "mars_block_size", "mars_draft_candidates", "mars_lookup", "mars_mask_cost")
# Every key a generation config may hold for MARS (an unknown `mars_*` key there is a typo, and refused)
SETTING_KEYS = (
    "mars_tau",
    "mars_block_size",
    "mars_confidence",
    "mars_verify",
    "mars_draft_candidates",
    "mars_lookup",
    "mars_mask_cost",
    "mars_lossless",
    "mars_acceptance",
    "mars_accept",
    "mars_typical_epsilon",
    "mars_typical_delta",
)
TREE_KEYS = ("mars_block_size", "mars_draft_candidates", "mars_lookup")
# Keys a generation config holds for lossless mode's presets; as `generate()` keywords, the call's config's
CONFIG_KEYS = ("mars_lossless", "mars_acceptance")


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


def check_verify(verify) -> bool:
    """Validate `mars_verify`: a bool, not something truthy (a "False" string would turn lossless mode on)."""
    if not isinstance(verify, bool):
        raise ValueError(f"mars_verify must be True or False, got {verify!r}")
    return verify


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
    draft_candidates: int | tuple[int, ...] = 1
    lookup: int = 0
    mask_cost: float | tuple[float, ...] = 0.0
    accept: str = "exact"
    typical_epsilon: float | None = None
    typical_delta: float | None = None

    def __post_init__(self):
        if not callable(self.tau):
            check_tau(self.tau)
        _check_count("mars_block_size", self.block_size, 1)
        if self.confidence not in CONFIDENCE_MEASURES:
            raise ValueError(f"mars_confidence must be one of {CONFIDENCE_MEASURES}, got {self.confidence!r}")
        check_verify(self.verify)
        _check_candidates(self.draft_candidates, self.block_size)
        _check_count("mars_lookup", self.lookup, 0)
        shaping = (("mars_draft_candidates", runner_ups(self.draft_candidates)), ("mars_lookup", self.lookup))
        for name, value in shaping:
            if value and not self.verify:
                raise ValueError(f"{name} shapes lossless mode's draft tree: it needs mars_verify=True.")
        _check_mask_cost(self.mask_cost, self.block_size)
        _check_accept(self.accept, self.verify, self.typical_epsilon, self.typical_delta)

    @property
    def any_tree(self) -> bool:
        """Whether these rows' text is the same whatever lossless draft tree they draft (lossless mode, or τ = 1, its
        plain form): what lets their tree change between passes."""
        return self.verify or self.tau == 1.0

    @property
    def typical(self) -> tuple[float, float] | None:
        """`(ε, δ)` of typical acceptance, or None where drafts are kept exactly."""
        if self.accept != "typical":
            return None
        epsilon, delta = self.typical_epsilon, self.typical_delta
        return (TYPICAL_EPSILON if epsilon is None else epsilon, TYPICAL_DELTA if delta is None else delta)

    @property
    def plain(self) -> bool:
        """Lossless mode without drafts or masks: plain decoding, which `generate()` runs as the base model's."""
        return self.verify and self.drafts_per_pass == 0

    @property
    def drafts_per_pass(self) -> int:
        """The most drafts a pass verifies (lossless mode) or masks it may accept (τ-mode)."""
        masks = self.block_size - 1
        return masks + runner_ups(self.draft_candidates) + self.lookup if self.verify else masks

    def as_kwargs(self) -> dict:
        """The `generate()` keyword arguments these settings stand for (`mars_tau=...`, ...): a call passed them
        decodes as these settings do. The mask token is the model's (`config.mars_mask_token_id`), not a keyword."""
        kwargs = {f"mars_{name}": value for name, value in asdict(self).items() if name != "mask_token_id"}
        kwargs["mars_tau"] = self.tau  # a callable τ stays itself (asdict copies it): calls share it, live
        for name in ("mars_mask_cost", "mars_draft_candidates"):
            kwargs[name] = list(kwargs[name]) if isinstance(kwargs[name], tuple) else kwargs[name]
        return kwargs


def resolve_settings(
    model, generation_config=None, batch_size: int = 1, call: dict | None = None, timer=None, **kwargs
) -> MARSSettings | None:
    """`MARSSettings` for these `mars_*` kwargs at this batch size; `None` means plain `generate()` (no τ anywhere).

    Each setting is the first one set of: the keyword, `generation_config` (the call's), `model.generation_config`
    (in lossless mode each config's `mars_lossless` preset before its own keys), the default. Lossless mode's output
    does not depend on τ, so it runs without one (τ = 0: every draft is proposed, the tree's shape bounds the pass).
    `call`: the call's other `generate()` kwargs, which say whether its passes are compiled (see `compiles`).
    Resolving times nothing: pass costs not measured yet count as paying for nothing (`mars_lossless="auto"` decodes
    plainly, `mars_mask_cost="auto"` is 0, with a warning that says how to measure them). A `timer` (hf_mars's
    tooling: `hf_mars.measure`, the explicit call) times what is missing first.
    """
    unknown = sorted(set(kwargs) - set(SETTING_KEYS))
    if unknown:
        raise ValueError(f"Unknown MARS setting(s): {unknown}; known: {list(SETTING_KEYS)}")
    own = model.generation_config
    configs = [own] if generation_config is None or generation_config is own else [generation_config, own]
    called = {name: kwargs.pop(name) for name in CONFIG_KEYS if kwargs.get(name) is not None}
    if called:  # a keyword of a config's own key is the call's config's, as `generate()` reads any config key
        configs.insert(0, SimpleNamespace(**called))
    for config in configs:
        _check_keys(config)
    verify = check_verify(
        _first_set(kwargs.get("mars_verify"), *(getattr(c, "mars_verify", None) for c in configs), False)
    )
    layers = _layers(model, configs, verify, batch_size, call or {}, timer, kwargs)

    def setting(name, default=None):
        return _first_set(kwargs.get(name), *(layer.get(name) for layer in layers), default)

    tau = setting("mars_tau", 0.0 if verify else None)
    if tau is None:
        stray = sorted(name for name, value in kwargs.items() if value is not None and name != "mars_verify")
        if stray:
            raise ValueError(f"{stray[0]} has no effect without mars_tau or mars_verify=True (plain generate()).")
        return None
    mask_token_id = getattr(model.config, "mars_mask_token_id", None)
    if mask_token_id is None:
        raise ValueError(
            "This model has no `<|mask|>` token id (config.mars_mask_token_id); convert it with "
            "`hf_mars.to_mars(model, tokenizer)` before decoding with `mars_tau`."
        )
    trained = getattr(model.config, "mars_block_size", None)
    block_size = setting("mars_block_size", trained)
    if isinstance(trained, int) and isinstance(block_size, int) and block_size > trained:
        raise ValueError(
            f"mars_block_size={block_size} exceeds the block size this model was trained with ({trained}): its masks "
            "predict at most that many tokens ahead."
        )
    cost = setting("mars_mask_cost", 0.0)
    if cost == "auto" and isinstance(block_size, int) and block_size >= 1:
        cost = mask_costs(model, batch_size, block_size, timer)
    return MARSSettings(
        tau=tau,
        block_size=block_size,
        mask_token_id=mask_token_id,
        confidence=setting("mars_confidence", "probability"),
        verify=verify,
        draft_candidates=_as_tuple(setting("mars_draft_candidates", 1)),
        lookup=setting("mars_lookup", 0),
        mask_cost=_as_tuple(cost),
        accept=setting("mars_accept", "exact"),
        typical_epsilon=setting("mars_typical_epsilon"),
        typical_delta=setting("mars_typical_delta"),
    )


def _layers(model, configs, verify: bool, batch_size: int, call: dict, timer, kwargs: dict) -> list[dict]:
    """Where each setting is looked up after its keyword, in order: lossless mode's tree chosen on this machine
    (where the configs ask for "auto" and no keyword shapes the tree), then each config's preset and own keys."""
    layers = []
    for config in configs:
        layers += [lossless_preset(config, batch_size), _held(config)] if verify else [_held(config)]
    if verify and all(kwargs.get(key) is None for key in TREE_KEYS) and wants_auto(configs):
        chains = _chains_only(call.get("logits_processor"))
        layers.insert(0, auto_tree(model, configs, batch_size, compiles(model, configs, call), timer, chains))
    return layers


def _chains_only(processors) -> bool:
    """Whether the call's own logits processors keep lossless drafts a chain (`scoring.branching`'s rule: one that
    reads more of the history than which tokens it holds, such as a grammar)."""
    from .scoring import branching

    return not branching(False, None, processors or ())


def mars_settings(model, generation_config=None, batch_size: int = 1, timer=None, **kwargs) -> dict | None:
    """What `generate(**kwargs)` runs with at this batch size, as `generate()` kwargs with every default resolved;
    `None`: plain `generate()`. See `resolve_settings` (and its `timer`); `cache_implementation` and
    `compile_config` count as in `generate()`."""
    call = {name: kwargs.pop(name) for name in CALL_KEYS if name in kwargs}
    settings = resolve_settings(model, generation_config, batch_size, call, timer, **kwargs)
    return None if settings is None else settings.as_kwargs()


def wants_auto(configs) -> bool:
    """Lossless mode picks its tree on this machine (`costs.py`) where the first config that sets `mars_lossless`
    sets "auto", or where none sets it and one holds the checkpoint's `mars_acceptance`."""
    preset = _first_set(*(getattr(c, "mars_lossless", None) for c in configs))
    return preset == "auto" or (preset is None and any(getattr(c, "mars_acceptance", None) for c in configs))


# The `generate()` kwargs, besides the `mars_*` ones, that settings read: whether the passes are compiled, and the
# call's own logits processors (whether lossless drafts may branch)
CALL_KEYS = ("cache_implementation", "compile_config", "disable_compile", "logits_processor")


def compiles(model, configs, call: dict):
    """The `CompileConfig` that `generate()` compiles this call's passes with, or None where it does not compile
    them. Its own rule for a static cache, which every MARS call's runner decodes on (the default call's its own):
    compiling not disabled, on a GPU (elsewhere only with a `compile_config` told to compile on every device)."""

    def read(name):
        return _first_set(call.get(name), *(getattr(c, name, None) for c in configs))

    config = read("compile_config")
    if read("disable_compile"):
        return None
    if model.device.type == "cuda":
        return config or CompileConfig()
    return config if getattr(config, "_compile_all_devices", False) else None


def auto_tree(model, configs, batch_size: int, compile_config=None, timer=None, chains: bool = False) -> dict:
    """The tree of the checkpoint's `mars_acceptance` with the most tokens per second at this batch size on this
    machine, as lossless settings; B = 1 (no drafts: plain decoding) where none beats plain decoding. With the
    `compile_config` of a call whose passes are compiled, the costs are those of compiled passes
    (`compiled_pass_costs`), not eager ones. Where this machine's are not timed (or not trusted), what is known of
    this kind of device (`prior_costs`) chooses. `chains`: the call's drafts stay a chain (`_chains_only`), so only
    the chains measured (one candidate, no lookup) are chosen from: a tree's acceptance is not its chain's."""
    acceptance = _first_set(*(getattr(c, "mars_acceptance", None) for c in configs))
    if acceptance is None:
        raise ValueError(
            'mars_lossless="auto" needs the checkpoint\'s mars_acceptance: `hf-mars tune --save` measures it.'
        )
    acceptance = check_acceptance(acceptance)
    if chains:
        acceptance = {name: rate for name, rate in acceptance.items() if parse_tree(name)[1:] == (1, 0)}
        if not acceptance:  # no chain measured: plain decoding
            return dict(zip(TREE_KEYS, (1, 1, 0)), mars_tau=0.0)
    trees = [parse_tree(name) for name in acceptance]
    widths, limit = [pass_width(*tree) for tree in trees], pay_limit(acceptance)
    try:
        if compile_config is not None:
            costs = compiled_pass_costs(model, batch_size, trees, compile_config, acceptance, timer)
        else:
            costs = pass_costs(model, batch_size, widths, limit=limit, timer=timer)
    except NotMeasured:  # not timed yet (or untrusted), and not timed now: what is known of this kind of device
        warn_not_measured('mars_lossless="auto"', model, batch_size)
        costs = prior_costs(model, batch_size, widths)
    tree = choose_tree(acceptance, costs) or (1, 1, 0)
    return dict(zip(TREE_KEYS, tree), mars_tau=0.0)


def lossless_preset(generation_config, batch_size: int = 1) -> dict:
    """`generation_config.mars_lossless` for this batch size, checked; {} when there is none (or it is "auto").

    It is a tree by name (`"2x3+4"`, as `mars_acceptance` and `hf-mars tune` write trees), a dict over
    `LOSSLESS_KEYS`, or either by batch size (`{"1": {...}, "4": "2x1"}`): a batch uses the entry of the largest size
    it reaches, else the smallest.
    """
    preset = getattr(generation_config, "mars_lossless", None) or {}
    if preset == "auto":
        return {}
    if isinstance(preset, dict) and preset and all(isinstance(k, str) and k.isdigit() for k in preset):
        sizes = sorted(int(k) for k in preset)
        preset = preset[str(max([n for n in sizes if n <= batch_size] or sizes[:1]))]
    if isinstance(preset, str):
        return dict(zip(TREE_KEYS, parse_tree(preset)))
    if not isinstance(preset, dict) or not set(preset) <= set(LOSSLESS_KEYS):
        raise ValueError(
            f'mars_lossless must be "auto", a tree such as "2x3+4", or a dict over {LOSSLESS_KEYS} (or those by batch '
            f"size), got {getattr(generation_config, 'mars_lossless', None)!r}"
        )
    return preset


def _held(generation_config) -> dict:
    """The MARS settings a generation config holds (None: not set)."""
    return {key: getattr(generation_config, key, None) for key in SETTING_KEYS}


def _check_keys(generation_config) -> None:
    unknown = sorted(k for k in vars(generation_config) if k.startswith("mars_") and k not in SETTING_KEYS)
    if unknown:
        raise ValueError(f"Unknown MARS setting(s) in the generation config: {unknown}; known: {list(SETTING_KEYS)}")


def _check_count(name: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def _check_candidates(candidates, block_size: int) -> None:
    """An int >= 1 (candidates for the first draft), or counts >= 1 per draft depth, one for each of at most B-1."""
    if not isinstance(candidates, (list, tuple)):
        _check_count("mars_draft_candidates", candidates, 1)
        return
    depths = block_size - 1
    counts = all(not isinstance(k, bool) and isinstance(k, int) and k >= 1 for k in candidates)
    if not (counts and 1 <= len(candidates) <= depths):
        raise ValueError(
            "mars_draft_candidates must be an integer >= 1 (candidates for the first draft) or a list of them, one "
            f"per draft depth, at most B-1 = {depths} long, got {list(candidates)!r}"
        )


def _check_accept(accept, verify: bool, epsilon, delta) -> None:
    """`mars_accept` is a rule of lossless mode's; ε in (0, 1] and δ >= 0 belong to typical acceptance only."""
    if accept not in ACCEPT_RULES:
        raise ValueError(f"mars_accept must be one of {ACCEPT_RULES}, got {accept!r}")
    if accept != "exact" and not verify:
        raise ValueError(f'mars_accept="{accept}" decides which drafts a pass keeps: it needs mars_verify=True.')
    for name, value in (("mars_typical_epsilon", epsilon), ("mars_typical_delta", delta)):
        if value is None:
            continue
        if accept != "typical":
            raise ValueError(f'{name} sets typical acceptance: it needs mars_accept="typical".')
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    if epsilon is not None and not 0 < epsilon <= 1:
        raise ValueError(f"mars_typical_epsilon is a probability in (0, 1], got {epsilon!r}")


def _as_tuple(value):
    """A list read from a generation config (JSON) as a tuple, which the frozen settings can hold."""
    return tuple(value) if isinstance(value, list) else value


def _check_mask_cost(cost, block_size: int) -> None:
    costs = list(cost) if isinstance(cost, (list, tuple)) else [cost]
    if isinstance(cost, (list, tuple)) and len(costs) != block_size - 1:
        raise ValueError(
            f"mars_mask_cost as a list needs one cost per mask count 1..B-1 ({block_size - 1}), got {list(costs)!r}"
        )
    if not all(not isinstance(c, bool) and isinstance(c, (int, float)) and 0 <= c < math.inf for c in costs):
        raise ValueError(
            f'mars_mask_cost must be a number >= 0, a list of them (0 = B-1 masks every pass) or "auto" (measured '
            f"on this machine), got {cost!r}"
        )


def _first_set(*values):
    return next((v for v in values if v is not None), None)
