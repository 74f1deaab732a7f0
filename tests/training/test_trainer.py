"""MARSTrainer on tiny models: the loss is the spec's, it trains, and what cannot work is refused."""

import copy

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from helpers import make_model, make_tokenizer
from transformers import HfArgumentParser, Qwen2ForCausalLM
from trl import SFTConfig

from hf_mars.training.trainer import MARSConfig, MARSTrainer

MASK = "<|mask|>"


def mars_tokenizer():
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [MASK]}, replace_extra_special_tokens=False)
    return tok


def mars_model(tok, family="qwen2", **overrides):
    model = make_model(family, attn_implementation="sdpa", **overrides)
    model.config.mars_mask_token_id = tok.convert_tokens_to_ids(MASK)
    return model


def config(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,
        save_strategy="no",
        logging_steps=1,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        max_steps=2,
        disable_tqdm=True,
        mars_block_size=4,
        seed=0,
    )
    kwargs.update(overrides)
    return MARSConfig(**kwargs)


def counting_chat(n=16, pad=0):
    """Deterministic chat data: 'count from k' -> 'k k+1 ... k+7'. `pad` widens the prompt by 0..pad-1 chars."""
    rows = []
    for i in range(n):
        k = i % 9
        user = f"count from {k}" + "." * (i % pad if pad else 0)
        answer = " ".join(str(k + j) for j in range(8))
        rows.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]})
    return Dataset.from_list(rows)


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def test_training_lowers_both_losses(tmp_path):
    tok = mars_tokenizer()
    trainer = MARSTrainer(
        mars_model(tok), args=config(tmp_path, max_steps=16), train_dataset=counting_chat(), processing_class=tok
    )
    trainer.train()
    clean, mask = logged(trainer, "clean_loss"), logged(trainer, "mask_loss")
    assert len(clean) == len(mask) == 16
    assert sum(clean[-3:]) < 0.7 * sum(clean[:3])
    assert sum(mask[-3:]) < 0.7 * sum(mask[:3])
    assert {f"mask_acc_{m}" for m in range(4)} <= trainer.state.log_history[-2].keys()
    assert logged(trainer, "num_tokens")[-1] > logged(trainer, "num_tokens")[0] > 0


def reference_loss(model, batch, block_size, mask_id, eos_id, alpha):
    """The paper's loss done the slow way: one example at a time, the full 2l layout, a mask built with loops, full
    logits and torch's cross-entropy."""
    clean_terms, noisy_terms, first_labels = [], [], []
    for ids, attn, lab in zip(batch["input_ids"], batch["attention_mask"], batch["labels"]):
        n = int(attn.sum())
        ids, lab = ids[:n].tolist(), lab[:n].tolist()
        while len(ids) % block_size:  # EOS pads, labelled EOS
            ids.append(eos_id)
            lab.append(eos_id)
        length = len(ids)
        first_labels.append(next(p for p, x in enumerate(lab) if x != -100))
        noisy = [mask_id if x != -100 else t for t, x in zip(ids, lab)]
        allowed = torch.zeros(2 * length, 2 * length, dtype=torch.bool)
        for q in range(2 * length):
            for k in range(2 * length):
                qn, qp, kn, kp = q >= length, q % length, k >= length, k % length
                if not qn and not kn:
                    allowed[q, k] = kp <= qp
                elif qn and kn:
                    allowed[q, k] = kp // block_size == qp // block_size and kp <= qp
                elif qn:
                    allowed[q, k] = kp // block_size < qp // block_size
        logits = model(
            input_ids=torch.tensor([ids + noisy]),
            attention_mask=allowed[None, None],  # bool is the right format for sdpa
            position_ids=torch.arange(length).repeat(2)[None],
        ).logits[0]
        target = torch.tensor(lab[1:])
        clean_terms.append(F.cross_entropy(logits[: length - 1], target, ignore_index=-100))
        noisy_terms.append(F.cross_entropy(logits[length : 2 * length - 1], target, ignore_index=-100))
    clean, noisy = torch.stack(clean_terms).mean(), torch.stack(noisy_terms).mean()
    return noisy + alpha * clean, clean, noisy, first_labels


@pytest.mark.parametrize("block_size", [4, 3])
def test_loss_matches_hand_computation(tmp_path, block_size):
    tok = mars_tokenizer()
    model = mars_model(tok)
    data = counting_chat(n=6, pad=5)  # prompts of varied lengths: first labels at varied block offsets
    trainer = MARSTrainer(
        model,
        args=config(tmp_path, mars_block_size=block_size, mars_ar_weight=0.5),
        train_dataset=data,
        processing_class=tok,
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(6)])
    trainer.model.eval()
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    mask_id, eos_id = tok.convert_tokens_to_ids(MASK), tok.eos_token_id
    want, clean, noisy, first_labels = reference_loss(model, batch, block_size, mask_id, eos_id, alpha=0.5)
    want.backward()
    # the batch covers a first label on a block boundary (reuses a clean prediction) and inside a block
    assert {f % block_size == 0 for f in first_labels} == {True, False}
    assert len({f // block_size for f in first_labels}) > 1  # rows have different noisy starts
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():  # the gradients too: fused head, reused boundary prediction
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    metrics = trainer._metrics["eval"]
    assert metrics["clean_loss"][-1] == pytest.approx(clean.item(), rel=1e-5)
    assert metrics["mask_loss"][-1] == pytest.approx(noisy.item(), rel=1e-5)


def test_loss_is_divided_by_gradient_accumulation(tmp_path):
    tok = mars_tokenizer()
    trainer = MARSTrainer(
        mars_model(tok),
        args=config(tmp_path, gradient_accumulation_steps=2),
        train_dataset=counting_chat(n=4),
        processing_class=tok,
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    trainer.current_gradient_accumulation_steps = 2  # set by train()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, dict(batch))
    # the training loop passes `num_items_in_batch`, which would otherwise make Trainer take the loss as scaled
    num_items = (batch["labels"][:, 1:] != -100).sum()
    step_loss = trainer.training_step(trainer.model, dict(batch), num_items_in_batch=num_items)
    torch.testing.assert_close(step_loss, loss / 2)


def test_chat_loss_is_on_the_final_assistant_turn_only(tmp_path):
    tok = mars_tokenizer()
    chat = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "FIRST REPLY"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "final reply"},
    ]
    data = Dataset.from_list([{"messages": chat}] * 4)
    trainer = MARSTrainer(mars_model(tok), args=config(tmp_path), train_dataset=data, processing_class=tok)
    example = trainer.train_dataset[0]
    labelled = [t for t in example["labels"] if t != -100]
    assert tok.decode(labelled) == "final reply<|im_end|>\n"
    assert "FIRST REPLY" in tok.decode(example["input_ids"])
    trainer.train()
    assert logged(trainer, "mask_loss")

    bad = Dataset.from_list([{"messages": chat[:2]}])
    with pytest.raises(ValueError, match="final assistant turn"):
        MARSTrainer(mars_model(tok), args=config(tmp_path), train_dataset=bad, processing_class=tok)


def test_prompt_completion_and_plain_text(tmp_path):
    tok = mars_tokenizer()
    pc = Dataset.from_list([{"prompt": f"count from {k}:", "completion": f" {k} {k + 1} {k + 2}"} for k in range(8)])
    trainer = MARSTrainer(
        mars_model(tok), args=config(tmp_path), train_dataset=pc, eval_dataset=pc, processing_class=tok
    )
    example = trainer.train_dataset[0]
    assert tok.decode([t for t in example["labels"] if t != -100]) == " 0 1 2<|im_end|>"
    trainer.train()
    assert "eval_mask_loss" in trainer.evaluate()

    text = Dataset.from_list([{"text": f"{k} {k + 1} {k + 2} {k + 3}"} for k in range(8)])
    trainer = MARSTrainer(mars_model(tok), args=config(tmp_path), train_dataset=text, processing_class=tok)
    example = trainer.train_dataset[0]
    assert example["labels"] == example["input_ids"]  # loss on every token
    trainer.train()
    assert all(torch.isfinite(torch.tensor(logged(trainer, "loss"))))


def test_gradient_checkpointing_gives_the_same_losses(tmp_path):
    tok = mars_tokenizer()
    model = mars_model(tok)
    runs = []
    for checkpointing in (False, True):
        trainer = MARSTrainer(
            copy.deepcopy(model),
            args=config(tmp_path, activation_checkpointing=checkpointing),
            train_dataset=counting_chat(n=8),
            processing_class=tok,
        )
        trainer.train()
        assert trainer.model.is_activation_checkpointing == checkpointing
        runs.append(logged(trainer, "loss"))
    assert len(runs[0]) == 2
    assert runs[0] == pytest.approx(runs[1], rel=1e-4)


def test_lora_trains_only_the_adapter_and_the_mask_row(tmp_path):
    from peft import LoraConfig

    tok = mars_tokenizer()
    model = mars_model(tok)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = MARSTrainer(
        model,
        args=config(tmp_path, max_steps=3, activation_checkpointing=True),
        train_dataset=counting_chat(n=8),
        processing_class=tok,
        peft_config=lora,
    )
    mask_id = model.config.mars_mask_token_id
    trainer.train()
    adapters = 0
    for name, p in trainer.model.named_parameters():
        if "trainable_tokens_delta" in name:  # the <|mask|> row, trained alongside the adapter
            assert p.shape[0] == 1
            assert not torch.equal(p[0], before["model.embed_tokens.weight"][mask_id]), name
        elif "lora_" in name:
            adapters += 1
            if "lora_B" in name:  # B starts at zero, so it must have moved
                assert not torch.equal(p, torch.zeros_like(p)), name
        else:
            base_name = name.removeprefix("base_model.model.").replace(".base_layer", "").replace(".token_adapter", "")
            assert torch.equal(p, before[base_name]), name
    assert adapters == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    assert trainer.model.get_base_model().config.mars_block_size == 4


def test_block_size_is_saved_in_the_model_config(tmp_path):
    tok = mars_tokenizer()
    model = mars_model(tok)
    args = config(tmp_path, mars_block_size=8)
    MARSTrainer(model, args=args, train_dataset=counting_chat(n=2), processing_class=tok)
    assert model.config.mars_block_size == 8
    assert model.generation_config.mars_block_size == 8


def test_mask_token_found_from_tokenizer(tmp_path):
    tok = mars_tokenizer()
    model = make_model("qwen2", attn_implementation="sdpa")  # no config.mars_mask_token_id
    trainer = MARSTrainer(model, args=config(tmp_path), train_dataset=counting_chat(n=2), processing_class=tok)
    assert trainer.mask_token_id == tok.convert_tokens_to_ids(MASK) == model.config.mars_mask_token_id


def test_config_fields_reach_the_argument_parser(tmp_path):
    parser = HfArgumentParser(MARSConfig)
    assert "--mars_block_size" in parser.format_help()
    (args,) = parser.parse_args_into_dataclasses(
        [
            "--output_dir",
            str(tmp_path),
            "--mars_block_size",
            "8",
            "--mars_ar_weight",
            "0.5",
            "--use_cpu",
            "true",
            "--bf16",
            "false",
            "--report_to",
            "none",
        ]
    )
    assert (args.mars_block_size, args.mars_ar_weight) == (8, 0.5)


@pytest.mark.parametrize(
    "overrides",
    [{"mars_block_size": 0}, {"mars_ar_weight": -1.0}, {"packing": True}, {"padding_free": True}],
)
def test_bad_config_values_raise(tmp_path, overrides):
    with pytest.raises(ValueError):
        config(tmp_path, **overrides)


def test_unsupported_setups_raise(tmp_path):
    tok = mars_tokenizer()
    data = counting_chat(n=2)

    def build(model=None, args=None, **kwargs):
        kwargs.setdefault("processing_class", tok)
        return MARSTrainer(model or mars_model(tok), args=args or config(tmp_path), train_dataset=data, **kwargs)

    with pytest.raises(ValueError, match="compute_loss_func"):
        build(compute_loss_func=lambda *a, **k: 0)
    with pytest.raises(ValueError, match="label_smoothing"):
        build(args=config(tmp_path, label_smoothing_factor=0.1))
    with pytest.raises(ValueError, match="to_mars"):
        build(model=make_model("qwen2", attn_implementation="sdpa"), processing_class=make_tokenizer())
    flash = mars_model(tok)
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="custom attention mask"):
        build(model=flash)
    with pytest.raises(ValueError, match="sliding-window"):
        build(
            model=mars_model(tok, use_sliding_window=True, sliding_window=16, max_window_layers=0),
            args=config(tmp_path, max_length=64),
        )

    class NoPositionIds(Qwen2ForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    no_pos = NoPositionIds(mars_model(tok).config)
    with pytest.raises(ValueError, match="position_ids"):
        build(model=no_pos)


def test_sft_config_is_converted(tmp_path):
    tok = mars_tokenizer()
    args = SFTConfig(str(tmp_path), use_cpu=True, bf16=False, report_to="none", activation_checkpointing=False)
    trainer = MARSTrainer(mars_model(tok), args=args, train_dataset=counting_chat(n=2), processing_class=tok)
    assert isinstance(trainer.args, MARSConfig) and trainer.args.mars_block_size == 4
