"""hf_mars: MARS (Mask AutoRegression) for Hugging Face causal LMs.

A MARS model is an ordinary causal LM fine-tuned so that `<|mask|>` tokens appended to the text predict the tokens
after the next one. `generate(mars_tau=τ)` then accepts several tokens per forward pass while their confidence is
at least τ; τ = 1 is exactly the checkpoint's own one-token decoding (the fine-tuned model's, not its base's).
"""

__version__ = "0.1.0"

import importlib

# Every public name loads on first use (PEP 562): `import hf_mars` and `hf-mars --help` pull in no torch, the decoding
# names no TRL (the trainer) and no huggingface_hub upload machinery (the Hub helpers).
_NAMES = {
    ".decoding.generate": ("MARSGenerationMixin", "MARSGenerateOutput", "MARSStats", "TauController", "mars_settings"),
    ".decoding.modeling": ("MASK_TOKEN", "mars_class"),
    ".decoding.session": ("Session",),
    ".grammar": ("GrammarProcessor",),
    ".tools.measure.passes": ("measure",),
    ".tools.measure.dtypes": ("choose_dtype",),
    ".convert": ("convert_checkpoint", "to_mars"),
    ".tools.checkpoints.shipped": ("default_checkpoint",),
    ".tools.checkpoints.loading": ("CheckpointError", "load_checkpoint"),
    ".training.trainer": ("MARSConfig", "MARSTrainer"),
    ".hub": ("push_to_hub", "push_space"),
}
_MODULE_OF = {name: module for module, names in _NAMES.items() for name in names}


def __getattr__(name):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'hf_mars' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name], __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_MODULE_OF))


__all__ = sorted(_MODULE_OF)
