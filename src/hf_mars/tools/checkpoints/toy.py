"""A toy MARS set-up that needs no download: a byte-level tokenizer, tiny models, and a counting task.

It serves the tests (models built from a config) and `hf-mars demo`, which trains a small model with `MARSTrainer`
in a couple of CPU minutes and shows MARS decoding emerge: the counting task is predictable several tokens ahead,
so a trained model accepts several tokens per pass at high τ.
"""

from __future__ import annotations

import random

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CONFIGS = {
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "gemma3": Gemma3TextConfig,
}


def toy_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level (every string round-trips), Qwen-style chat tokens, 259 ids, left padding for generation."""
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


def toy_model(family: str = "qwen2", vocab_size: int = 272, seed: int = 0, dtype=torch.float32, **overrides):
    """A small `family` model (2 layers, width 64 unless overridden). The default vocabulary leaves spare embedding
    rows past the toy tokenizer's 259 ids, as Qwen2.5's matrix does, so `<|mask|>` needs no resize."""
    tok = toy_tokenizer()
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
    )
    if family == "qwen3":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[family](**kwargs), dtype=dtype)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model.eval()


def counting_example(rng: random.Random) -> dict:
    """A prompt and its one right answer from three easy, regular tasks: counting, the alphabet, repetition.

    Like much of real text they are predictable several tokens ahead, which is what MARS turns into speed.
    """
    kind = rng.choice(["count", "letters", "repeat"])
    if kind == "count":
        start = rng.randint(0, 80)
        stop = start + rng.randint(4, 19)
        prompt, answer = f"Count from {start} to {stop}.", " ".join(str(n) for n in range(start, stop + 1))
    elif kind == "letters":
        start = rng.randint(0, 20)
        stop = rng.randint(start + 3, 25)
        letters = "abcdefghijklmnopqrstuvwxyz"[start : stop + 1]
        prompt, answer = f"Write the letters from {letters[0]} to {letters[-1]}.", " ".join(letters)
    else:
        word = rng.choice(["cat", "blue", "seven", "river", "hello", "tree", "moon", "sun", "apple", "stone"])
        times = rng.randint(2, 9)
        prompt, answer = f"Repeat {word} {times} times.", " ".join([word] * times)
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


def counting_dataset(n: int, seed: int = 0) -> list[dict]:
    """`n` examples of `counting_example`, reproducible from `seed` (use different seeds for training and testing)."""
    rng = random.Random(seed)
    return [counting_example(rng) for _ in range(n)]
