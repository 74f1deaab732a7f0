"""`hf-mars train` / examples/train_mars.py, run as a user runs them: a local JSONL dataset, full or LoRA training,
resuming."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_model, make_tokenizer
from transformers import AutoModelForCausalLM

from hf_mars.tools.checkpoints.toy import counting_dataset

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_mars.py"  # a thin wrapper of hf_mars.train


def train(tmp_path, *extra, cli=False):
    model_dir, data = tmp_path / "base", tmp_path / "train.jsonl"
    if not model_dir.exists():
        make_model("llama").save_pretrained(model_dir)
        make_tokenizer().save_pretrained(model_dir)
        data.write_text("".join(json.dumps(ex) + "\n" for ex in counting_dataset(40)))
    args = [
        "--model_name_or_path",
        str(model_dir),
        "--dataset_name",
        str(data),
        "--per_device_train_batch_size",
        "4",
        "--use_cpu",
        "--bf16",
        "false",
        "--report_to",
        "none",
        "--mars_block_size",
        "4",
        "--logging_steps",
        "1",
        "--activation_checkpointing",
        "false",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "hf_mars.cli", "train"] if cli else [sys.executable, str(SCRIPT)]
    result = subprocess.run([*command, *args], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def test_full_training_saves_a_mars_checkpoint(tmp_path):
    log = train(tmp_path, "--output_dir", str(tmp_path / "out"), "--max_steps", "4", "--save_strategy", "no", cli=True)
    assert "'mask_loss'" in log and "'clean_loss'" in log and "'mask_acc_0'" in log
    out = tmp_path / "out"
    assert {"modeling.py", "generate.py", "cache.py", "model.safetensors"} <= {p.name for p in out.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert model.config.mars_block_size == 4
    result = model.generate(
        input_ids=torch.tensor([[1, 80, 81]]), mars_tau=0.5, max_new_tokens=6, return_dict_in_generate=True
    )
    assert result.mars_stats.forward_passes >= 1


@pytest.mark.slow  # two training subprocesses: 20-31 s on 2 cores
def test_lora_and_resume(tmp_path):
    out = tmp_path / "lora"
    lora = ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "q_proj", "v_proj"]
    train(
        tmp_path, "--output_dir", str(out), "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "2", *lora
    )
    assert (out / "adapter_config.json").exists() and (out / "checkpoint-2").exists()
    assert json.loads((out / "mars.json").read_text())["mars_block_size"] == 4
    log = train(
        tmp_path,
        "--output_dir",
        str(out),
        "--max_steps",
        "4",
        "--save_strategy",
        "steps",
        "--save_steps",
        "2",
        "--resume_from_checkpoint",
        "true",
        *lora,
    )
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2, 3, 4]
    assert log.count("'mask_loss'") == 2  # the resumed run trained steps 3 and 4 only


@pytest.mark.slow  # two training subprocesses: 30-46 s on 2 cores
def test_init_adapter_continues_a_finished_lora_run(tmp_path):
    from safetensors.torch import load_file

    first, second = tmp_path / "first", tmp_path / "second"
    lora = ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "q_proj", "v_proj"]
    train(
        tmp_path,
        "--output_dir",
        str(first),
        "--max_steps",
        "3",
        "--learning_rate",
        "1e-2",
        "--save_strategy",
        "no",
        *lora,
    )
    # Learning rate 0: the new run must save exactly the adapter it started from (a fresh LoRA has lora_B = 0).
    train(
        tmp_path,
        "--output_dir",
        str(second),
        "--max_steps",
        "1",
        "--learning_rate",
        "0",
        "--save_strategy",
        "no",
        "--init_adapter",
        str(first),
    )
    before = load_file(first / "adapter_model.safetensors")
    after = load_file(second / "adapter_model.safetensors")
    trained = [k for k in before if "lora_B" in k or "trainable_tokens_delta" in k]
    assert trained and any(before[k].abs().sum() > 0 for k in trained)
    assert all(torch.equal(before[k], after[k]) for k in trained)
    assert json.loads((second / "mars.json").read_text())["mars_block_size"] == 4
