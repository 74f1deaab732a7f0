"""`hf-mars demo`: MARS end to end on a CPU in a few minutes, with nothing to download.

Trains a small Llama-architecture model from scratch with `MARSTrainer` on a counting task (both losses at once: the
clean stream teaches the task, the noisy stream teaches the masks to look ahead), then decodes held-out prompts with
MARS at several τ and prints, for each: tokens per forward pass, exact-answer accuracy, agreement with τ = 1, and the
wall-clock speed-up over transformers' own `generate()` on the same model.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import GenerationMixin

from ...convert import to_mars
from ...training.trainer import MARSConfig, MARSTrainer
from .toy import counting_dataset, toy_model, toy_tokenizer

TAUS = (1.0, 0.95, 0.9, 0.8, 0.7)


def train_toy(steps: int, block_size: int, output_dir: str | Path, seed: int = 0):
    """A ~0.9M-parameter MARS model trained on `steps` batches of 16 counting examples."""

    tokenizer = toy_tokenizer()
    model = toy_model(
        "llama", hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, seed=seed
    )
    to_mars(model, tokenizer, block_size=block_size)
    args = MARSConfig(
        str(output_dir),
        mars_block_size=block_size,
        max_steps=steps,
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, steps // 20),
        logging_steps=max(1, steps // 6),
        max_length=160,
        bf16=False,
        activation_checkpointing=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        seed=seed,
    )
    train = Dataset.from_list(counting_dataset(steps * 16, seed=seed))
    MARSTrainer(model, args=args, train_dataset=train, processing_class=tokenizer).train()
    return model.eval(), tokenizer


def evaluate(model, tokenizer, n_prompts: int = 32, taus=TAUS, seed: int = 1234) -> list[dict]:
    """Decode held-out prompts (a different seed from training) at each τ, batched; one row of figures per τ."""
    test = counting_dataset(n_prompts, seed=seed)
    prompts = [
        tokenizer.apply_chat_template(ex["messages"][:1], add_generation_prompt=True, tokenize=False) for ex in test
    ]
    answers = [ex["messages"][1]["content"] for ex in test]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    rows, reference = [], None
    for tau in taus:
        out = model.generate(**enc, mars_tau=tau, max_new_tokens=120, return_dict_in_generate=True)
        texts = tokenizer.batch_decode(out.sequences[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
        reference = texts if reference is None else reference
        rows.append(
            dict(
                tau=tau,
                tokens_per_forward=out.mars_stats.new_tokens.sum().item() / out.mars_stats.passes_per_row.sum().item(),
                accuracy=sum(t.strip() == a for t, a in zip(texts, answers)) / len(test),
                same_as_tau1=sum(t == r for t, r in zip(texts, reference)) / len(test),
            )
        )
    return rows


def wall_clock(model, tokenizer, tau: float, n_prompts: int = 8, seed: int = 99) -> tuple[float, float]:
    """Batch-1 tokens/s of transformers' `generate()` and of MARS at `tau`, alternating prompt by prompt."""
    test = counting_dataset(n_prompts, seed=seed)
    seconds, tokens = {"ar": 0.0, "mars": 0.0}, {"ar": 0, "mars": 0}
    for ex in test:
        enc = tokenizer.apply_chat_template(
            ex["messages"][:1], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        for name, run in (
            ("ar", lambda enc=enc: GenerationMixin.generate(model, **enc, do_sample=False, max_new_tokens=120)),
            ("mars", lambda enc=enc: model.generate(**enc, mars_tau=tau, max_new_tokens=120)),
        ):
            run()  # warm-up
            start = time.perf_counter()
            out = run()
            seconds[name] += time.perf_counter() - start
            tokens[name] += out.shape[1] - enc["input_ids"].shape[1]
    return tokens["ar"] / seconds["ar"], tokens["mars"] / seconds["mars"]


def run_demo(
    steps: int = 800,
    block_size: int = 4,
    output_dir: str | Path = "outputs/mars-demo",
    tau: float = 0.9,
    eval_prompts: int = 32,
    timing_prompts: int = 8,
):
    torch.manual_seed(0)
    print(f"Training a toy MARS model (B={block_size}) for {steps} steps on a counting task...")
    model, tokenizer = train_toy(steps, block_size, output_dir)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)

    print(f"\nHeld-out prompts, batched greedy MARS decoding (saved to {output_dir}):")
    print(f"{'tau':>5} {'tokens/forward':>15} {'accuracy':>9} {'same as tau=1':>14}")
    for row in evaluate(model, tokenizer, n_prompts=eval_prompts):
        print(
            f"{row['tau']:>5} {row['tokens_per_forward']:>15.2f} {row['accuracy']:>9.0%} {row['same_as_tau1']:>14.0%}"
        )
    ar, mars = wall_clock(model, tokenizer, tau, n_prompts=timing_prompts)
    print(
        f"\nBatch 1, this machine: plain generate() {ar:.0f} tokens/s, MARS τ={tau} {mars:.0f} tokens/s: "
        f"{mars / ar:.2f}x"
    )
    example = "Count from 40 to 58."
    print(f'\nTry it: hf-mars generate {output_dir} --prompt "{example}" --tau {tau}')
