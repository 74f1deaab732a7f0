"""Time one MARSTrainer training step against one SFTTrainer step on the same batch and model.

MARS runs one forward over `[clean | noisy tail]`, so its step costs more than an SFT step on the same batch (the
authors' full two-stream layout costs more still). This prints both medians and their ratio.

    python examples/bench_train_step.py                  # 31M-param Llama, batch 4 x 256-512 tokens, 40 % prompt
    python examples/bench_train_step.py --vocab 32000 --hidden 384 --layers 6 --threads 1

The default model gives the LM head about the share of the FLOPs it has in Qwen2.5-0.5B (~27 %). MARS's extra cost
is `l + T` forward tokens for SFT's `l` (T: the noisy tail, about the response length) and two scored streams, so
a larger head share raises the ratio; on CPU, TRL's fused-head fallback also grows faster than linearly.

Steps alternate (SFT, MARS, SFT, ...) after a warm-up, so drift in machine load hits both alike. A step is the
trainer's `training_step` (forward + backward, with the trainer's own loss), plus an AdamW update with --optimizer.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
import warnings

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config
from trl import SFTConfig, SFTTrainer

from hf_mars.training.trainer import MARSConfig, MARSTrainer, pad_to_blocks, two_stream_batch


def make_batch(args, vocab_size: int, eos_id: int, pad_id: int) -> dict:
    """A right-padded batch as TRL's collator makes it: prompt tokens labelled -100, response and EOS labelled."""
    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.batch_size,), generator=gen)
    width = int(lengths.max())
    input_ids = torch.full((args.batch_size, width), pad_id)
    labels = torch.full((args.batch_size, width), -100)
    attention_mask = torch.zeros(args.batch_size, width, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        prompt = round(n * args.prompt_frac)
        tokens = torch.randint(3, vocab_size - 1, (n,), generator=gen)
        tokens[-1] = eos_id
        input_ids[i, :n], attention_mask[i, :n], labels[i, prompt:n] = tokens, 1, tokens[prompt:]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def make_tokenizer() -> PreTrainedTokenizerFast:
    # Only the special tokens matter: the batch is made of token ids
    backend = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def make_model(args):
    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[args.family]
    config = config_cls(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 64 // 2),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        attn_implementation=args.attn,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
    )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config)
    model.config.mars_mask_token_id = args.vocab - 1  # a spare row, as after hf_mars.to_mars
    return model


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="llama", choices=["llama", "qwen2"])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--prompt-frac", type=float, default=0.4)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--optimizer", action="store_true", help="include an AdamW update in each step")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def make_trainers(args, tokenizer) -> dict:
    """An SFTTrainer and a MARSTrainer on identical copies of one model, ready for `training_step`."""
    sft_model = make_model(args)
    mars_model = copy.deepcopy(sft_model)
    dummy = Dataset.from_dict({"input_ids": [[3, 4, 1]], "labels": [[-100, 4, 1]]})  # trainers require one
    use_gpu = torch.cuda.is_available()
    common = dict(
        output_dir=tempfile.mkdtemp(),
        report_to="none",
        use_cpu=not use_gpu,
        bf16=use_gpu,
        activation_checkpointing=False,
        max_length=None,
        learning_rate=1e-5,
    )
    sft = SFTTrainer(sft_model, args=SFTConfig(**common), train_dataset=dummy, processing_class=tokenizer)
    mars = MARSTrainer(
        mars_model,
        args=MARSConfig(**common, mars_block_size=args.block_size),
        train_dataset=dummy,
        processing_class=tokenizer,
    )
    for trainer in (sft, mars):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by `train()`, which we do not run
    return {"sft": sft, "mars": mars}


def time_steps(args, trainers: dict, batch: dict) -> dict[str, list[float]]:
    """Seconds per step, SFT and MARS alternating after `args.warmup` untimed rounds."""
    optimizers = {name: torch.optim.AdamW(t.model.parameters(), lr=1e-5) for name, t in trainers.items()}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def step(name, trainer):
        inputs = {k: v.to(trainer.args.device) for k, v in batch.items()}
        sync()
        start = time.perf_counter()
        trainer.training_step(trainer.model, inputs)
        if args.optimizer:
            optimizers[name].step()
        sync()
        elapsed = time.perf_counter() - start
        optimizers[name].zero_grad(set_to_none=True)
        return elapsed

    times = {name: [] for name in trainers}
    for i in range(args.warmup + args.repeats):
        for name, trainer in trainers.items():
            t = step(name, trainer)
            if i >= args.warmup:
                times[name].append(t)
    return times


def report(args, trainers: dict, batch: dict, times: dict) -> None:
    sft = trainers["sft"]
    n_params = sum(p.numel() for p in sft.model.parameters())
    labelled = (batch["labels"] != -100).sum().item()
    real = batch["attention_mask"].sum().item()
    print(
        f"model: {args.family}, {n_params / 1e6:.1f}M params, attn={args.attn}, device={sft.args.device}, "
        f"threads={torch.get_num_threads()}"
    )
    print(
        f"batch: {args.batch_size} x {batch['input_ids'].shape[1]} tokens ({real} real, {labelled / real:.0%} "
        f"labelled), B={args.block_size}, step={'fwd+bwd+AdamW' if args.optimizer else 'fwd+bwd'}"
    )
    padded = pad_to_blocks(batch["input_ids"], batch["attention_mask"], batch["labels"], args.block_size, 1)
    mars_width = two_stream_batch(*padded, args.block_size, args.vocab - 1)["input_ids"].shape[1]
    sft_width = batch["input_ids"].shape[1]
    print(f"forward width: SFT {sft_width}, MARS {mars_width} (clean + noisy tail), {mars_width / sft_width:.2f}x")
    sft_t, mars_t = statistics.median(times["sft"]), statistics.median(times["mars"])
    print(f"SFT  step median: {sft_t * 1e3:8.1f} ms  ({', '.join(f'{t * 1e3:.0f}' for t in times['sft'])})")
    print(f"MARS step median: {mars_t * 1e3:8.1f} ms  ({', '.join(f'{t * 1e3:.0f}' for t in times['mars'])})")
    print(f"MARS / SFT: {mars_t / sft_t:.2f}x")


def main():
    args = parse_args()
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = make_tokenizer()
    trainers = make_trainers(args, tokenizer)
    batch = make_batch(args, args.vocab, tokenizer.eos_token_id, tokenizer.pad_token_id)
    report(args, trainers, batch, time_steps(args, trainers, batch))


if __name__ == "__main__":
    main()
