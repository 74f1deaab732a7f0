"""MARS model classes: any transformers causal LM with MARS decoding mixed into `generate()`.

`MARSQwen2ForCausalLM`, `MARSLlamaForCausalLM`, ... are built on first use from the transformers class they extend:
same weights, same forward, one new `generate()` argument. A checkpoint saved by hf_mars keeps its base `model_type`
and `architectures` and names `modeling.MARS<Base>` in `auto_map`, so it loads as the MARS class with
`trust_remote_code=True`, as the plain base model without it, and on engines that pick their own model code by the
name in `architectures` (vLLM, SGLang, `transformers serve`).

This file is copied into MARS checkpoints (trust_remote_code): it imports transformers and `generate.py` only.
"""

from __future__ import annotations

import functools
import inspect
import os

import transformers

# Every sibling file is imported here by name: transformers loaders before 5.10 copy into their modules cache only the
# files that the class's own file imports, not what those import in turn.
from .cache import StaticMARSCache
from .commit import cut
from .compat import TESTED_TRANSFORMERS, warn_if_untested
from .costs import choose_tree
from .generate import MARSGenerateOutput, MARSGenerationMixin, MARSStats
from .graph import graph_pass
from .graph_state import GraphPass
from .ordered_attention import NAME as ORDERED
from .ordered_attention import ordered_attention
from .ordered_linear import OrderedLinear, order_linears
from .runner import Runner
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
    "graph_pass",
    "ordered_attention",
    "OrderedLinear",
    "MARSGenerateOutput",
    "MARSGenerationMixin",
    "MARSSettings",
    "MARSStats",
    "MaskSchedule",
    "Runner",
    "STATELESS",
    "Session",
    "StaticMARSCache",
    "Stopping",
    "choose_tree",
    "cut",
    "TauController",
    "mars_class",
    "set_mask_token",
]

MASK_TOKEN = "<|mask|>"
_classes: dict[str, type] = {}


def set_mask_token(config, mask_id: int) -> None:
    """Name `<|mask|>` in a model config under both keys that read it: `mars_mask_token_id` (hf_mars) and
    `mask_token_id`, where vLLM's parallel drafting looks for the token it feeds a drafter after the last token."""
    config.mars_mask_token_id = config.mask_token_id = mask_id


class SavedAsBase:
    """Saves a MARS model under its base class's name.

    transformers writes the saving class's name into `config.architectures`, and serving engines choose their model
    code by that name: `MARSLlamaForCausalLM` is unknown to vLLM, `LlamaForCausalLM` runs on its own kernels. The
    MARS class still loads through `auto_map` with `trust_remote_code=True`.
    """

    _mars_base: type

    def save_pretrained(self, save_directory, *args, push_to_hub: bool = False, **kwargs):
        if push_to_hub:  # save here, then let push_to_hub save a copy through this method and upload it
            saving = set(inspect.signature(transformers.PreTrainedModel.save_pretrained).parameters) - {"kwargs"}
            self.save_pretrained(save_directory, *args, **{k: v for k, v in kwargs.items() if k in saving})
            hub = {k: v for k, v in kwargs.items() if k not in saving or k == "token"}
            repo_id = hub.pop("repo_id", os.path.basename(os.path.normpath(save_directory)))
            return self.push_to_hub(repo_id, **hub)
        super().save_pretrained(save_directory, *args, **kwargs)
        self.config.architectures = [self._mars_base.__name__]
        self.config.save_pretrained(save_directory)


def ordering_linears(forward):
    """`forward`, whose model's linear layers are `OrderedLinear`s while its attention is `ordered`: however the model
    was made (loaded, converted, its attention set later), its first forward after a change of attention swaps them."""

    @functools.wraps(forward)
    def ordered_forward(self, *args, **kwargs):
        ordered = self.config._attn_implementation == ORDERED
        if getattr(self, "_mars_ordered_linears", False) != ordered:
            order_linears(self, ordered)
            self._mars_ordered_linears = ordered
        return forward(self, *args, **kwargs)

    return ordered_forward


def mars_class(base: type) -> type:
    """The MARS subclass of a transformers causal-LM class (created once, registered for `AutoModelForCausalLM`)."""
    if issubclass(base, MARSGenerationMixin):
        return base
    name = f"MARS{base.__name__}"
    if name not in _classes:
        warn_if_untested()
        bases = (SavedAsBase, MARSGenerationMixin, base)
        names = {"__module__": __name__, "__doc__": f"{base.__name__} + MARS.", "_mars_base": base}
        names["forward"] = ordering_linears(base.forward)
        cls = type(name, bases, names)
        cls.register_for_auto_class("AutoModelForCausalLM")
        _classes[name] = cls
    return _classes[name]


def __getattr__(name: str) -> type:
    # `auto_map` names the class as "modeling.MARS<Base>"; build it when transformers looks it up.
    base = getattr(transformers, name[len("MARS") :], None) if name.startswith("MARS") else None
    if isinstance(base, type) and issubclass(base, transformers.PreTrainedModel):
        return mars_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
