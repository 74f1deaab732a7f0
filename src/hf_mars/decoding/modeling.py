"""MARS model classes: any transformers causal LM with MARS decoding mixed into `generate()`.

`MARSQwen2ForCausalLM`, `MARSLlamaForCausalLM`, ... are built on first use from the transformers class they extend:
same weights, same forward, one new `generate()` argument. A checkpoint saved by hf_mars keeps its base `model_type`
and names `modeling.MARS<Base>` in `auto_map`, so it loads as the MARS class with `trust_remote_code=True` and as the
plain base model without it.

This file is copied into MARS checkpoints (trust_remote_code): it imports transformers and `generate.py` only.
"""

from __future__ import annotations

import transformers

# Every sibling file is imported here by name: transformers loaders before 5.10 copy into their modules cache only the
# files that the class's own file imports, not what those import in turn.
from .cache import MARSCache, StaticMARSCache
from .compat import TESTED_TRANSFORMERS, warn_if_untested
from .costs import choose_tree
from .generate import MARSGenerateOutput, MARSGenerationMixin, MARSStats
from .graph import GraphPass
from .schedule import MaskSchedule
from .scoring import STATELESS
from .session import Session
from .settings import MARSSettings, TauController
from .stopping import Stopping
from .tree import DraftTree
from .verify import Drafts

__all__ = [
    "TESTED_TRANSFORMERS",
    "DraftTree",
    "Drafts",
    "GraphPass",
    "MARSCache",
    "MARSGenerateOutput",
    "MARSGenerationMixin",
    "MARSSettings",
    "MARSStats",
    "MaskSchedule",
    "STATELESS",
    "Session",
    "StaticMARSCache",
    "Stopping",
    "choose_tree",
    "TauController",
    "mars_class",
]

MASK_TOKEN = "<|mask|>"
_classes: dict[str, type] = {}


def mars_class(base: type) -> type:
    """The MARS subclass of a transformers causal-LM class (created once, registered for `AutoModelForCausalLM`)."""
    if issubclass(base, MARSGenerationMixin):
        return base
    name = f"MARS{base.__name__}"
    if name not in _classes:
        warn_if_untested()
        cls = type(name, (MARSGenerationMixin, base), {"__module__": __name__, "__doc__": f"{base.__name__} + MARS."})
        cls.register_for_auto_class("AutoModelForCausalLM")
        _classes[name] = cls
    return _classes[name]


def __getattr__(name: str) -> type:
    # `auto_map` names the class as "modeling.MARS<Base>"; build it when transformers looks it up.
    base = getattr(transformers, name[len("MARS") :], None) if name.startswith("MARS") else None
    if isinstance(base, type) and issubclass(base, transformers.PreTrainedModel):
        return mars_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
