"""hf_mars: MARS (Mask AutoRegression) for Hugging Face causal LMs.

A MARS model is an ordinary causal LM fine-tuned so that `<|mask|>` tokens appended to the text predict the tokens
after the next one. `generate(mars_tau=τ)` then accepts several tokens per forward pass while their confidence is
at least τ; τ = 1 is exactly the original autoregressive model.
"""

__version__ = "0.1.0"

from .decoding.cache import MARSCache
from .decoding.generate import MARSGenerationMixin, MARSGenerateOutput, MARSStats, TauController, mars_settings
from .convert import convert_checkpoint, to_mars
from .decoding.modeling import MASK_TOKEN, mars_class
from .tools.shipped import default_checkpoint


def __getattr__(name):
    # The trainer pulls in TRL (and datasets), the Hub helpers huggingface_hub's upload machinery; decoding users
    # should not pay for those imports.
    if name in ("MARSTrainer", "MARSConfig"):
        from .training import trainer

        return getattr(trainer, name)
    if name in ("push_to_hub", "push_space"):
        from . import hub

        return getattr(hub, name)
    raise AttributeError(f"module 'hf_mars' has no attribute {name!r}")


__all__ = [
    "MASK_TOKEN",
    "MARSCache",
    "MARSConfig",
    "MARSGenerateOutput",
    "MARSGenerationMixin",
    "MARSStats",
    "MARSTrainer",
    "TauController",
    "convert_checkpoint",
    "default_checkpoint",
    "mars_class",
    "mars_settings",
    "push_space",
    "push_to_hub",
    "to_mars",
]
