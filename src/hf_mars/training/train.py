"""Train a MARS model, TRL-style: TRL's `sft.py` with `MARSTrainer` / `MARSConfig`.

Run as `hf-mars train ...` or `python examples/train_mars.py ...` (the same arguments).

```bash
# CPU, a local chat JSONL (`messages` per line), LoRA
hf-mars train \
    --model_name_or_path HuggingFaceTB/SmolLM2-135M-Instruct --dataset_name data/train.jsonl \
    --mars_block_size 4 --learning_rate 5e-5 --num_train_epochs 1 --per_device_train_batch_size 8 \
    --use_peft --lora_r 32 --lora_alpha 64 --use_cpu --bf16 false --output_dir outputs/mars-smollm2

# several GPUs: DeepSpeed/FSDP come from the accelerate config, not from this script
accelerate launch --config_file zero2.yaml examples/train_mars.py --model_name_or_path Qwen/Qwen2.5-7B-Instruct \
    --dataset_name allenai/Dolci-Instruct-SFT --mars_block_size 8 --learning_rate 5e-6 --num_train_epochs 5 \
    --lr_scheduler_type cosine --warmup_steps 0.03 --max_length 512 --output_dir outputs/mars-qwen2.5-7b
```

`--resume_from_checkpoint true` (or a checkpoint folder) resumes an interrupted run from the newest checkpoint in
`--output_dir`, optimizer and scheduler included (`TimeBudget` stops a run at such a point on purpose).
`--init_adapter FOLDER` starts a new run (new data, schedule, steps) from a finished LoRA MARS adapter, e.g. a
previous `--use_peft` output or the shipped delta. Progress and the MARS metrics
(`clean_loss`, `mask_loss`, `mask_acc_{m}`) are logged every `--logging_steps`. The saved folder is a MARS checkpoint
(remote code included); with `--use_peft` it holds the adapter, which `merge_and_unload()` folds into the base.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from accelerate.utils import broadcast_object_list
from transformers import TrainerCallback
from trl import ModelConfig


@dataclass
class MARSModelConfig(ModelConfig):
    """TRL's `ModelConfig`, plus a LoRA MARS adapter to continue training from."""

    init_adapter: str | None = field(
        default=None,
        metadata={
            "help": "Continue training this LoRA MARS adapter (a `--use_peft` output folder, or the shipped "
            "delta) instead of a fresh one; its LoRA settings replace the --lora_* arguments."
        },
    )


def load_train_eval(script_args, training_args):
    """The dataset from the Hub or from a local .json/.jsonl/.parquet file (offline machines have only the latter)."""
    from datasets import load_dataset

    name = script_args.dataset_name
    if name is None:
        raise ValueError("--dataset_name is required: a Hub dataset id or a local .json/.jsonl/.parquet file.")
    suffix = Path(name).suffix
    if Path(name).exists() and suffix in (".json", ".jsonl", ".parquet"):
        dataset = load_dataset("parquet" if suffix == ".parquet" else "json", data_files={"train": name})
    else:
        dataset = load_dataset(name, name=script_args.dataset_config)
    train = dataset[script_args.dataset_train_split]
    evaluation = None
    if training_args.eval_strategy != "no":
        evaluation = dataset[script_args.dataset_test_split]
    return train, evaluation


def resume_point(training_args):
    """`--resume_from_checkpoint`: a checkpoint folder, or `true`/`last` for the newest one in --output_dir."""
    from transformers.trainer_utils import get_last_checkpoint

    resume = training_args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("true", "last"):
        resume = get_last_checkpoint(training_args.output_dir)
        if resume is None:
            raise ValueError(
                f"--resume_from_checkpoint {training_args.resume_from_checkpoint}: no checkpoint in "
                f"{training_args.output_dir}"
            )
    return resume


def check_processes(training_args) -> None:
    """Refuse a launch of several processes that would train as that many unsynchronised copies.

    torchrun (and `accelerate launch` with a GPU or FSDP config, which runs torchrun) starts the processes, but on a
    machine without a GPU they join one process group (gloo) only with `--use_cpu`: otherwise each trains alone on
    the whole data set, and all of them write the same output folder.
    """
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and training_args.world_size != launched:
        raise ValueError(
            f"{launched} processes were launched, but each would train alone (world size {training_args.world_size}):"
            " on a machine without a GPU pass --use_cpu, which makes them train together over gloo."
        )


class TimeBudget(TrainerCallback):
    """Stop training at the first step that ends at or after `deadline` (a `time.monotonic()` value), saving a
    checkpoint there: its weights, optimizer, scheduler and RNG states let `--resume_from_checkpoint` continue the
    run, on this machine or on another one, as if it had not stopped. Under several processes the main process's
    clock decides, so that all of them stop at the same step."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.stopped = False

    def on_step_end(self, args, state, control, **kwargs):
        (spent,) = broadcast_object_list([time.monotonic() >= self.deadline])
        if spent and state.global_step < state.max_steps:
            control.should_save = True
            control.should_training_stop = True
            self.stopped = True
        return control


def train(script_args, training_args, model_args, callbacks=()) -> bool:
    """Train with TRL's three settings objects (`make_parser` reads them from a command line) and `callbacks`.

    Returns True once the model is saved in `output_dir`; False when a `TimeBudget` stopped training before its
    last step: then only the checkpoint saved there is written, and the final save is left to the run that resumes
    from it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import get_peft_config

    import hf_mars

    check_processes(training_args)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision)
    model = AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path,
        revision=model_args.model_revision,
        attn_implementation=model_args.attn_implementation or "sdpa",
        dtype=model_args.dtype,
    )
    hf_mars.to_mars(model, tokenizer, block_size=training_args.mars_block_size)
    peft_config = get_peft_config(model_args)
    if model_args.init_adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, model_args.init_adapter, is_trainable=True)
        peft_config = None
    train_set, evaluation = load_train_eval(script_args, training_args)
    trainer = hf_mars.MARSTrainer(
        model,
        args=training_args,
        train_dataset=train_set,
        eval_dataset=evaluation,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=list(callbacks),
    )
    trainer.train(resume_from_checkpoint=resume_point(training_args))
    if any(isinstance(callback, TimeBudget) and callback.stopped for callback in callbacks):
        trainer.accelerator.print(f"Stopped by the time budget at step {trainer.state.global_step}, checkpoint saved")
        return False
    trainer.save_model(training_args.output_dir)
    trainer.save_state()  # trainer_state.json: the steps and the logs, beside the model
    if model_args.use_peft or model_args.init_adapter:  # an adapter folder has no model config: keep the MARS settings
        base = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
        mars = {key: getattr(base.config, key) for key in ("mars_block_size", "mars_mask_token_id")}
        if trainer.accelerator.is_main_process:
            (Path(training_args.output_dir) / "mars.json").write_text(json.dumps(mars, indent=2))
    trainer.accelerator.print(f"Saved the MARS model to {training_args.output_dir}")
    return True


def make_parser():
    from trl import ScriptArguments, TrlParser

    from hf_mars import MARSConfig

    return TrlParser((ScriptArguments, MARSConfig, MARSModelConfig))


def run(argv=None) -> None:
    """Parse TRL-style arguments (or a `--config` YAML) and train."""
    script_args, training_args, model_args = make_parser().parse_args_and_config(args=argv)
    train(script_args, training_args, model_args)
