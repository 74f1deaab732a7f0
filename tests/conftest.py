"""Tiny models and a tokenizer built offline, so every test runs without the Hub.

The tokenizer is byte-level (every string round-trips) with Qwen-style chat special tokens; the models are
2-layer Qwen2 / Qwen3 / Llama configs whose embedding matrix has a few spare rows, as Qwen2.5's does.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen3Config

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=SPECIALS[1:],
        padding_side="left",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


FAMILIES = {
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "llama": LlamaConfig,
}


def make_model(family: str = "qwen2", vocab_size: int = 272, seed: int = 0, dtype=torch.float32, **overrides):
    """A 2-layer model of `family`. The default vocab leaves spare rows past the tokenizer's 259 tokens."""
    tok = make_tokenizer()
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=0.2,  # peaked distributions: confidences spread over (0, 1), so τ matters
    )
    if family == "qwen3":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    config = FAMILIES[family](**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model.eval()


@pytest.fixture
def tokenizer():
    return make_tokenizer()
