"""MARS training (arXiv 2604.07023): TRL's SFTTrainer with the two-stream mask-prediction loss.

Everything but the loss is SFTTrainer's: dataset preparation, collation, PEFT, gradient checkpointing, logging. Per
batch, `MARSTrainer.compute_loss`

1. pads every labelled row with EOS up to a multiple of the block size B (the pads are labelled EOS);
2. builds the noisy stream, a copy with every labelled token replaced by `<|mask|>`, keeping only the tail that
   starts at the block of each row's first label (earlier noisy blocks would just repeat the clean outputs);
3. runs one forward over `[clean | noisy tail]` with the two-stream mask of `masking.py`, scoring the next-token
   log-probabilities with TRL's fused LM head (no `(batch, seq, vocab)` logits);
4. returns CE(noisy) + α·CE(clean), each averaged per sequence over its labelled tokens, then over the batch.

Usage::

    model, tokenizer = hf_mars.to_mars(model, tokenizer, block_size=4)
    trainer = MARSTrainer(model, args=MARSConfig("out", mars_block_size=4), train_dataset=chat_dataset,
                          processing_class=tokenizer)
    trainer.train()
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field

import torch
from accelerate.utils import is_peft_model
from datasets import Dataset
from trl import SFTConfig, SFTTrainer
from trl.data_utils import is_conversational_from_value, maybe_convert_to_chatml

from ..decoding.modeling import MASK_TOKEN, set_mask_token
from .masking import SUPPORTED_ATTENTION, create_two_stream_mask, two_stream_position_ids


@dataclass
class MARSConfig(SFTConfig):
    r"""
    Configuration for [`MARSTrainer`]: every [`~trl.SFTConfig`] field, plus the two MARS hyper-parameters.

    Parameters:
        mars_block_size (`int`, *optional*, defaults to `4`):
            Block size B: the number of `<|mask|>` tokens predicted in parallel, hence the most tokens one decoding
            forward pass can accept. The authors used 4, 8 and 16. It is written to the model config so that a saved
            checkpoint decodes with the B it was trained with.
        mars_ar_weight (`float`, *optional*, defaults to `1.0`):
            Weight α of the clean-stream (ordinary next-token) loss in CE(noisy) + α·CE(clean). It keeps one-token
            quality from decaying as B grows.
    """

    mars_block_size: int = field(
        default=4,
        metadata={
            "help": "Block size B: number of <|mask|> tokens predicted in parallel (the authors used 4, 8 or 16). "
            "Saved in the model config so the checkpoint decodes with the B it was trained with."
        },
    )
    mars_ar_weight: float = field(
        default=1.0,
        metadata={"help": "Weight α of the clean-stream next-token loss in CE(noisy) + α·CE(clean)."},
    )

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.mars_block_size, bool) or not isinstance(self.mars_block_size, int):
            raise ValueError(f"`mars_block_size` must be an integer >= 1, got {self.mars_block_size!r}.")
        if self.mars_block_size < 1:
            raise ValueError(f"`mars_block_size` must be >= 1, got {self.mars_block_size}.")
        if not self.mars_ar_weight >= 0:  # also catches NaN
            raise ValueError(f"`mars_ar_weight` must be >= 0, got {self.mars_ar_weight}.")
        if self.packing or self.eval_packing or self.padding_free:
            raise ValueError(
                "MARS does not support `packing` or `padding_free`: each example needs its own two-stream layout and "
                "block grid, which packed rows cannot have. Set `packing=False` and `padding_free=False`."
            )


def final_turn_only(example: dict) -> dict:
    """Turn a `messages` example into conversational prompt/completion with the last message as completion.

    MARS trains on the final assistant turn only, as the authors did; as prompt/completion data, TRL's completion-only
    loss then labels exactly that turn.
    """
    messages = example["messages"]
    if not messages or messages[-1]["role"] != "assistant":
        role = messages[-1]["role"] if messages else None
        raise ValueError(f"MARS trains on the final assistant turn, but an example ends with a {role!r} message.")
    return {"prompt": messages[:-1], "completion": messages[-1:]}


def _to_final_turn_dataset(dataset, num_proc: int | None = None):
    """Apply `final_turn_only` to an untokenized chat dataset; leave any other dataset as it is."""
    if dataset is None:
        return None
    if isinstance(dataset, dict):
        return {name: _to_final_turn_dataset(d, num_proc) for name, d in dataset.items()}
    first = next(iter(dataset))
    if "input_ids" in first:
        return dataset
    map_kwargs = {"num_proc": num_proc} if isinstance(dataset, Dataset) else {}  # IterableDataset has no num_proc
    if is_conversational_from_value(first):
        dataset = dataset.map(maybe_convert_to_chatml, remove_columns=["conversations"], **map_kwargs)
        first = next(iter(dataset))
    if "messages" in first and "prompt" not in first:
        dataset = dataset.map(final_turn_only, remove_columns=["messages"], **map_kwargs)
    return dataset


def pad_to_blocks(input_ids, attention_mask, labels, block_size: int, eos_token_id: int):
    """Pad each labelled row with EOS up to a multiple of `block_size`; the pads are labelled EOS, as in the paper.

    Rows are right padded (TRL's collator). The batch widens when a row needs more room.
    """
    lengths = attention_mask.sum(1)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    if not torch.equal(attention_mask.bool(), positions < lengths[:, None]):
        raise ValueError("MARSTrainer expects right-padded batches (as TRL's collator makes them).")
    has_labels = (labels != -100).any(1)
    ends = torch.where(has_labels, -(-lengths // block_size) * block_size, lengths)
    width = int(ends.max())
    if width > input_ids.shape[1]:
        extra = width - input_ids.shape[1]
        input_ids = torch.nn.functional.pad(input_ids, (0, extra), value=eos_token_id)
        attention_mask = torch.nn.functional.pad(attention_mask, (0, extra), value=0)
        labels = torch.nn.functional.pad(labels, (0, extra), value=-100)
        positions = torch.arange(width, device=input_ids.device)
    eos_pad = (positions >= lengths[:, None]) & (positions < ends[:, None])
    return (
        input_ids.masked_fill(eos_pad, eos_token_id),
        attention_mask.masked_fill(eos_pad, 1),
        labels.masked_fill(eos_pad, eos_token_id),
    )


def two_stream_batch(input_ids, attention_mask, labels, block_size: int, mask_token_id: int) -> dict:
    """Token ids, padding masks and pre-shifted labels of `[clean | noisy tail]` for a block-padded batch.

    Row i's noisy tail starts at `noisy_start[i]`, the first position of the block holding its first label, and
    covers its remaining tokens. `shift_labels[:, p]` is the label the output at p predicts (the next token).
    The one noisy prediction left out, the output at `noisy_start - 1` predicting the label at `noisy_start`, equals
    the clean output there (that block has no labels), so the loss reuses the clean log-probability.
    """
    batch, length = input_ids.shape
    device = input_ids.device
    labelled = labels != -100
    lengths = attention_mask.sum(1)
    first_label = torch.where(labelled.any(1), labelled.int().argmax(1), lengths)
    noisy_start = first_label // block_size * block_size
    tail = max(int((lengths - noisy_start).max()), 1)

    positions = noisy_start[:, None] + torch.arange(tail, device=device)  # logical position of each noisy token
    gather_at = positions.clamp(max=length - 1)
    noisy_valid = positions < lengths[:, None]
    noisy_ids = torch.where(labelled, mask_token_id, input_ids).gather(1, gather_at)
    noisy_ids = noisy_ids.masked_fill(~noisy_valid, mask_token_id)

    no_label = torch.full((batch, 1), -100, dtype=labels.dtype, device=device)
    clean_shift = torch.cat([labels[:, 1:], no_label], dim=1)
    next_at = positions + 1
    noisy_shift = labels.gather(1, next_at.clamp(max=length - 1)).masked_fill(next_at >= length, -100)
    return {
        "input_ids": torch.cat([input_ids, noisy_ids], dim=1),
        "clean_attention_mask": attention_mask,
        "noisy_attention_mask": noisy_valid.to(attention_mask.dtype),
        "position_ids": two_stream_position_ids(length, tail, noisy_start),
        "shift_labels": torch.cat([clean_shift, noisy_shift], dim=1),
        "noisy_start": noisy_start,
    }


def _with_mask_row(peft_config, model):
    """With LoRA, also train the `<|mask|>` embedding row (peft's trainable tokens, a few KB in the adapter).

    The row is new (or a spare one): left frozen, every mask would enter the model as an untrained vector that the
    low-rank update has to work around. An explicit `trainable_token_indices` of the user's is kept.
    """
    from peft import LoraConfig

    mask_id = getattr(getattr(model, "config", None), "mars_mask_token_id", None)
    if not isinstance(peft_config, LoraConfig) or peft_config.trainable_token_indices is not None or mask_id is None:
        return peft_config
    return dataclasses.replace(peft_config, trainable_token_indices=[mask_id])


class MARSTrainer(SFTTrainer):
    """SFTTrainer that trains a causal LM for MARS multi-token decoding (see the module docstring).

    Takes the same arguments as [`~trl.SFTTrainer`]. `args` should be a [`MARSConfig`]; other training arguments are
    converted to one with the default B and α. Chat (`messages`) data is trained on its final assistant turn only;
    prompt/completion data on the completion; plain text on every token. The model must already know the
    `<|mask|>` token: run `hf_mars.to_mars(model, tokenizer, block_size=B)` first.
    """

    _tag_names = ["trl", "sft", "mars"]
    _name = "MARS"
    # compute_loss returns a per-micro-batch mean, not a sum normalised by `num_items_in_batch`: Trainer must divide
    # it by the gradient accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(
        self,
        model,
        args=None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        **kwargs,
    ):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = MARSConfig(f"{str(name).rstrip('/').split('/')[-1] or 'model'}-MARS")
        elif not isinstance(args, MARSConfig):
            # to_dict hides every `*_token` field (hub_token, but also SFTConfig's eos_token and pad_token)
            dict_args = {k: getattr(args, k) if k.endswith("_token") else v for k, v in args.to_dict().items()}
            args = MARSConfig(**dict_args)
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError("MARSTrainer computes its own loss; `compute_loss_func` is not supported.")
        if args.label_smoothing_factor > 0:
            raise ValueError("MARSTrainer does not support `label_smoothing_factor`.")
        if args.loss_type != "nll":
            raise ValueError(f"MARSTrainer uses the negative log-likelihood, not `loss_type={args.loss_type!r}`.")
        kwargs["peft_config"] = _with_mask_row(kwargs.get("peft_config"), model)
        # Convert chat data before SFTTrainer looks at it, so that it chooses completion-only loss
        train_dataset = _to_final_turn_dataset(train_dataset, args.dataset_num_proc)
        eval_dataset = _to_final_turn_dataset(eval_dataset, args.dataset_num_proc)
        super().__init__(
            model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            **kwargs,
        )

        base = self.model.get_base_model() if is_peft_model(self.model) else self.model
        self._check_model(base)
        head = base.get_output_embeddings()
        if head is not None and not hasattr(head, "bias"):
            # peft's TrainableTokensWrapper (the <|mask|> row of a tied LM head) has no `bias`; TRL's fused head
            # reads it
            head.bias = None
        self.mask_token_id = self._find_mask_token_id(base)
        eos = self._tokenizer.eos_token_id
        self.eos_token_id = eos if eos is not None else _first(base.config.get_text_config().eos_token_id)
        if self.eos_token_id is None:
            raise ValueError("MARS pads examples with EOS, but neither the tokenizer nor the model defines one.")
        # Saved checkpoints then decode with the B and the mask token they were trained with
        base.config.mars_block_size = args.mars_block_size
        set_mask_token(base.config, self.mask_token_id)
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.mars_block_size = args.mars_block_size

    def _check_model(self, base):
        """Refuse what would silently train with the wrong attention pattern."""
        if self._is_vision_dataset:
            raise ValueError("MARSTrainer supports text datasets only.")
        if "position_ids" not in inspect.signature(type(base).forward).parameters:
            raise ValueError(
                f"{type(base).__name__}.forward takes no `position_ids`; MARS needs them, since both streams reuse "
                "positions 0..l-1."
            )
        if self.aux_loss_enabled:
            raise ValueError("MARSTrainer does not support the MoE auxiliary loss; set `router_aux_loss_coef=0.0`.")
        config = base.config.get_text_config()
        if config._attn_implementation not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"MARS training needs a custom attention mask, which {config._attn_implementation!r} cannot take. "
                f"Load the model with attn_implementation in {SUPPORTED_ATTENTION} (sdpa is the usual choice)."
            )
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        if layer_types - {"full_attention", "sliding_attention"}:
            raise ValueError(f"MARSTrainer supports full and sliding-window attention layers only, not {layer_types}.")
        # Sliding layers receive the same two-stream mask; that is exact only if the window spans the whole sequence
        self._window = getattr(config, "sliding_window", None) if "sliding_attention" in layer_types else None
        if self._window is not None and self.args.max_length is not None:
            self._check_window(self.args.max_length + self.args.mars_block_size - 1)
        parallelism = self.accelerator.parallelism_config
        if any(getattr(parallelism, flag, False) for flag in ("cp_enabled", "sp_enabled")):
            raise ValueError("Context/sequence parallelism drops the attention mask; MARS needs it.")

    def _check_window(self, length: int):
        if self._window is not None and self._window < length:
            raise ValueError(
                f"The model has sliding-window layers (window {self._window}) shorter than the training sequence "
                f"({length} tokens); MARS gives every layer the full two-stream mask. Lower `max_length`."
            )

    def _find_mask_token_id(self, base) -> int:
        mask_id = getattr(base.config, "mars_mask_token_id", None)
        if mask_id is None and MASK_TOKEN in self._tokenizer.get_vocab():
            mask_id = self._tokenizer.convert_tokens_to_ids(MASK_TOKEN)
        if mask_id is None:
            raise ValueError(
                f"The model has no MARS mask token: neither `config.mars_mask_token_id` nor a {MASK_TOKEN!r} token in "
                "the tokenizer. Call `hf_mars.to_mars(model, tokenizer, block_size=...)` before training."
            )
        if mask_id >= base.get_input_embeddings().weight.shape[0]:
            raise ValueError(f"Mask token id {mask_id} is outside the embedding matrix; resize the embeddings.")
        return int(mask_id)

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        # `evaluate(eval_dataset=...)` prepares datasets that __init__ never saw
        dataset = _to_final_turn_dataset(dataset, args.dataset_num_proc)
        return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        block_size, alpha = self.args.mars_block_size, self.args.mars_ar_weight
        input_ids, attention_mask, labels = pad_to_blocks(
            inputs["input_ids"], inputs["attention_mask"], inputs["labels"], block_size, self.eos_token_id
        )
        length = input_ids.shape[1]
        self._check_window(length)
        batch = two_stream_batch(input_ids, attention_mask, labels, block_size, self.mask_token_id)
        noisy_start = batch["noisy_start"]
        attention = create_two_stream_mask(
            self.model.config,
            batch["clean_attention_mask"],
            batch["noisy_attention_mask"],
            block_size,
            noisy_start,
            dtype=self.model.dtype,
        )
        outputs = model(
            input_ids=batch["input_ids"],
            attention_mask=attention,
            position_ids=batch["position_ids"],
            shift_labels=batch["shift_labels"],
            fused_lm_head=True,
            use_cache=False,
        )
        clean_lp, noisy_lp = outputs.log_probs[:, :length], outputs.log_probs[:, length:]  # zero where unlabelled

        # A first label on a block boundary is predicted by the output just before the tail, the clean one
        before = (noisy_start - 1).clamp(min=0)[:, None]
        label_at_start = labels.gather(1, noisy_start.clamp(max=length - 1)[:, None])[:, 0]
        boundary = (noisy_start > 0) & (label_at_start != -100)
        boundary_lp = torch.where(boundary, clean_lp.gather(1, before)[:, 0], 0.0)

        # Per-sequence means over the labelled tokens (the first token has no prediction), then over the batch
        num_labels = (labels[:, 1:] != -100).sum(1)
        rows = (num_labels > 0).sum().clamp(min=1)
        clean_loss = (-clean_lp.sum(1) / num_labels.clamp(min=1)).sum() / rows
        mask_loss = (-(noisy_lp.sum(1) + boundary_lp) / num_labels.clamp(min=1)).sum() / rows
        loss = mask_loss + alpha * clean_loss

        self._log_mars_metrics(mode, inputs, outputs, length, boundary, before, clean_loss, mask_loss)
        if return_outputs:  # like SFTTrainer: logits for `compute_metrics` need a plain forward
            with torch.no_grad():
                outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
            return loss, outputs
        return loss

    @torch.no_grad()
    def _log_mars_metrics(self, mode, inputs, outputs, length, boundary, before, clean_loss, mask_loss):
        """Clean/noisy losses, clean-stream entropy and accuracy, and the noisy top-1 accuracy per block offset m.

        `mask_acc_{m}` is how often the mask at block offset m predicts its token (m + 2 ahead of the last clean
        token it sees): the training-time view of how many tokens a decoding pass can accept.
        """
        gather = self.accelerator.gather_for_metrics
        metrics = self._metrics[mode]
        metrics["clean_loss"].append(gather(clean_loss.detach()).mean().item())
        metrics["mask_loss"].append(gather(mask_loss.detach()).mean().item())

        clean_mask, noisy_mask = outputs.label_mask[:, :length], outputs.label_mask[:, length:]
        clean_top1, noisy_top1 = outputs.is_top1[:, :length], outputs.is_top1[:, length:]
        num_valid = gather(clean_mask.sum()).sum()
        if num_valid > 0:
            metrics["entropy"].append((gather(outputs.entropy[:, :length].sum()).sum() / num_valid).item())
            metrics["mean_token_accuracy"].append((gather(clean_top1.sum()).sum() / num_valid).item())

        # Noisy tails start on a block boundary, so column j of the tail is block offset j % B. The boundary
        # prediction sits at the last offset of the block before the tail.
        block_size = self.args.mars_block_size
        offset = torch.arange(noisy_mask.shape[1], device=noisy_mask.device) % block_size
        one_hot = torch.nn.functional.one_hot(offset, block_size).float()
        correct = noisy_top1.float().sum(0) @ one_hot
        counts = noisy_mask.float().sum(0) @ one_hot
        correct[-1] += (clean_top1.gather(1, before)[:, 0].bool() & boundary).sum()
        counts[-1] += boundary.sum()
        correct, counts = gather(correct[None]).sum(0), gather(counts[None]).sum(0)
        for m in range(block_size):
            if counts[m] > 0:
                metrics[f"mask_acc_{m}"].append((correct[m] / counts[m]).item())

        if mode == "train":  # SFTTrainer's token count, from the collator's 2D mask
            num_tokens = gather(inputs["attention_mask"].sum()).sum().item()
            self._total_train_tokens += num_tokens // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]


def _first(value):
    return value[0] if isinstance(value, (list, tuple)) else value
