"""The MARS recipe in one call, sized for one GPU: prompts → self-distillation → MARS training → export → evaluation.

Each stage writes its result under `output_dir` and is skipped when that result is there, so a re-run after an
interruption (or after a finished run) continues where the last one stopped:

1. prompts: `prompts.jsonl` and `prompts.json` (per-source counts, prompts dropped as overlapping an evaluation
   set), by `sourcing.build_prompt_mix`; done when `prompts.json` is there.
2. distill: `distilled.jsonl` (every answer; an interrupted run resumes it), `train.jsonl` (the finished answers)
   and `distill.json` (throughput), by `distillation.distill` and `distillation.write_training_set` on the device;
   done when `distill.json` is there.
3. train: `mars-lora/` or `mars-full/`, by `training.train.train` on TRL's settings objects (`train_settings`);
   TRL's checkpoints inside are resumed; done when the final save is there.
4. export: `delta/` (LoRA: the adapter and the `<|mask|>` row in float16, `shipped.export_delta`) and `checkpoint/`
   (the merged MARS checkpoint, `shipped.build_checkpoint` for the shipped base); done when `checkpoint/config.json`.
5. eval: `eval-lora/` or `eval-full/` (`eval.md`, `eval.json`, `eval.png`): the τ table of `evals.tau_table`,
   decoded on the device.

A full fine-tune's training folder is itself a MARS checkpoint (remote code included): the export stage has nothing
to do and `checkpoint` is `mars-full/`. The settings that define the data (prompts, sources, seed, base model,
answer length) are kept in `recipe.json`; a re-run with other values is refused instead of mixing two runs.

`time_budget` (seconds) bounds a whole run: distillation stops between batches, training at a step end with a
checkpoint (optimizer and scheduler included), and a later stage does not start once it is spent. `recipe.json`
records each stage as done, stopped (time budget) or not started. Nothing in the folder names the folder itself, so
the same command run in a copy of it, on another machine, continues the run.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ...training import train as training
from ..checkpoints.loading import load_checkpoint
from ..checkpoints.shipped import base_checkpoint, build_checkpoint, export_delta, merge_delta, save_checkpoint
from ..data.distillation import distill, write_training_set
from ..data.sourcing import build_prompt_mix
from ..evaluate.evals import evaluate_and_write
from .settings import DONE, NOT_STARTED, STOPPED, DataSettings, DistillSettings, Recipe

__all__ = ["Budget", "DataSettings", "DistillSettings", "Recipe", "run"]

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DATA_SETTINGS = ("prompts", "sources", "seed", "model", "max_new_tokens")


class Budget:
    """A run's time budget: `seconds` from its creation on `time.monotonic()`; None: no limit."""

    def __init__(self, seconds: float | None):
        self.deadline = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def spent(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch sees no CUDA device here (use --device cpu)")
    return device


def base_model(recipe: DataSettings) -> str:
    """The base model's folder: `recipe.model`, else the shipped checkpoint's base (built from its GGUF once)."""
    if recipe.model is not None:
        if not (Path(recipe.model) / "config.json").is_file():
            raise FileNotFoundError(f"--model {recipe.model}: no config.json there (pass a saved model's folder)")
        return recipe.model
    return str(base_checkpoint())


def data_settings(values: dict) -> dict:
    """The settings that define the data, as `recipe.json` records them: the base model by its folder's name, so
    that a copy of the run continues on a machine where the base model lies elsewhere."""
    settings = {key: values.get(key) for key in DATA_SETTINGS}
    settings["model"] = None if settings["model"] is None else Path(settings["model"]).name
    return settings


def check_settings(recipe: DataSettings) -> None:
    """Record the data-defining settings in recipe.json on the first run, refuse a re-run that changes them, and list
    this run's stages there (those not done yet as not started)."""
    path = recipe.out / "recipe.json"
    settings = data_settings(asdict(recipe))
    if path.is_file():
        record = json.loads(path.read_text())
        before = data_settings(record["data"])
        changed = [f"{k} {before.get(k)!r} -> {v!r}" for k, v in settings.items() if before.get(k) != v]
        if changed:
            raise ValueError(
                f"{recipe.out} holds a run made with other settings ({'; '.join(changed)}): "
                "use another --output-dir, or the same settings to continue it"
            )
    else:
        everything = {key: value for key, value in asdict(recipe).items() if key != "output_dir"}  # it may move
        record = {"data": settings, "all": everything | settings}
    record["stages"] = {stage: NOT_STARTED for stage in recipe.stages} | record.get("stages", {})
    recipe.out.mkdir(parents=True, exist_ok=True)
    _write_json(path, record)


def mark(recipe: DataSettings, stage: str, status: str) -> None:
    """Record in recipe.json how `stage` ended: done, or stopped (time budget)."""
    path = recipe.out / "recipe.json"
    record = json.loads(path.read_text())
    record["stages"][stage] = status
    _write_json(path, record)


def _write_json(path: Path, data: dict) -> None:
    """Replace `path` whole (the processes of `accelerate launch ... distill` read and write it at the same time),
    and only when `data` changes it: a run that finds everything done writes nothing."""
    text = json.dumps(data, indent=2)
    if path.is_file() and path.read_text() == text:
        return
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(text)
    os.replace(temporary, path)


def _skip(stage: str, path: Path) -> None:
    print(f"[{stage}] done already: {path}")


def _out_of_time(stage: str) -> bool:
    """Say that `stage` does not start; False, the stage's result (not done)."""
    print(f"[{stage}] not started: the time budget is spent")
    return False


def make_prompts(recipe: DataSettings) -> list[dict]:
    """Stage 1: the decontaminated prompt mix (sourcing.build_prompt_mix), as prompts.jsonl and a report."""
    path, report_path = recipe.out / "prompts.jsonl", recipe.out / "prompts.json"
    if report_path.is_file():
        _skip("prompts", path)
        mark(recipe, "prompts", DONE)
        return [json.loads(line) for line in path.open()]
    prompts, report = build_prompt_mix(recipe.prompts, recipe.sources, recipe.seed)
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    report_path.write_text(json.dumps(report, indent=2))
    mark(recipe, "prompts", DONE)
    dropped = sum(report["dropped_overlapping"].values())
    print(
        f"[prompts] {len(prompts)} prompts from {len(report['counts'])} sources; {dropped} dropped for sharing a "
        f"word {report['ngram']}-gram with GSM8K test or HumanEval: {path}"
    )
    return prompts


def self_distill(recipe: DataSettings, prompts: list[dict], budget: Budget) -> bool:
    """Stage 2: the base model answers the prompts (distillation.distill) on the device, within the budget; once
    every prompt is answered, train.jsonl keeps the finished answers. Returns whether the stage is done."""
    done = recipe.out / "distill.json"
    if done.is_file():
        _skip("distill", recipe.out / "train.jsonl")
        mark(recipe, "distill", DONE)
        return True
    if budget.spent():
        return _out_of_time("distill")
    device = resolve_device(recipe.device)
    base = base_model(recipe)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, recipe.dtype)).to(device).eval()
    batch = recipe.distill_batch_size or (512 if device.startswith("cuda") else 16)
    distilled = recipe.out / "distilled.jsonl"
    stats = distill(
        model,
        tokenizer,
        prompts,
        distilled,
        max_new_tokens=recipe.max_new_tokens,
        batch_size=batch,
        time_budget=budget.left(),
    )
    if stats["stopped"] != "done":
        mark(recipe, "distill", STOPPED)
        answered = len(distilled.read_text().splitlines())
        print(f"[distill] stopped by the time budget: {answered} of {len(prompts)} prompts answered ({distilled})")
        return False
    kept, total = write_training_set(distilled, recipe.out / "train.jsonl")
    if not kept:
        raise ValueError(
            f"none of the {total} answers finished within {recipe.max_new_tokens} tokens: nothing to train on; "
            "run again with a larger --max-new-tokens and another --output-dir"
        )
    stats.update(kept=kept, total=total, device=device, batch_size=batch)
    done.write_text(json.dumps(stats, indent=2))
    mark(recipe, "distill", DONE)
    rate = stats["new_tokens"] / max(stats["seconds"], 1e-9)
    print(
        f"[distill] {stats['answered']} prompts answered in {stats['seconds']:.0f} s ({rate:.0f} new tokens/s); "
        f"{kept} of {total} answers finished within {recipe.max_new_tokens} tokens"
    )
    return True


def train_settings(recipe: Recipe, base: str, device: str) -> tuple:
    """TRL's (script, MARSConfig, model) settings of this recipe's training: the recipe's values, with any
    `--train-args` parsed over them by `hf-mars train`'s own parser."""
    lr = recipe.learning_rate or (1e-4 if recipe.full_finetune else 4e-4)
    values = dict(model_name_or_path=base, dataset_name=str(recipe.out / "train.jsonl"))
    values.update(output_dir=str(recipe.train_dir), mars_block_size=recipe.block_size, seed=recipe.seed)
    values.update(num_train_epochs=recipe.epochs, per_device_train_batch_size=recipe.batch_size, learning_rate=lr)
    values.update(lr_scheduler_type="cosine", warmup_steps=0.03)
    values.update(max_length=recipe.max_length or recipe.max_new_tokens + 512)
    values.update(bf16=recipe.dtype == "bfloat16", activation_checkpointing=False, use_cpu=device == "cpu")
    values.update(logging_steps=10, report_to="none", save_strategy="steps", save_steps=200, save_total_limit=2)
    if not recipe.full_finetune:
        values.update(use_peft=True, lora_r=32, lora_alpha=64, lora_target_modules=list(LORA_TARGETS))
    if any(recipe.train_dir.glob("checkpoint-*")):
        values.update(resume_from_checkpoint="true")
    parser = training.make_parser()
    parser.set_defaults_with_config(**values)
    return tuple(parser.parse_args_into_dataclasses(args=shlex.split(recipe.train_args)))


def _trained(recipe: Recipe) -> bool:
    """The training stage's final save is there (checkpoints inside the folder do not count)."""
    if recipe.full_finetune:
        return (recipe.train_dir / "config.json").is_file() and any(recipe.train_dir.glob("*.safetensors"))
    return (recipe.train_dir / "mars.json").is_file()  # written after the adapter


def train(recipe: Recipe, budget: Budget) -> bool:
    """Stage 3: MARS training on train.jsonl, LoRA (rank 32, every linear layer) or a full fine-tune, stopped with a
    checkpoint when the budget is spent. Returns whether the stage is done."""
    stage = recipe.stages[2]
    if _trained(recipe):
        _skip(stage, recipe.train_dir)
        mark(recipe, stage, DONE)
        return True
    if budget.spent():
        return _out_of_time(stage)
    script_args, training_args, model_args = train_settings(recipe, base_model(recipe), resolve_device(recipe.device))
    resume = " from its newest checkpoint" if training_args.resume_from_checkpoint else ""
    print(f"[{stage}] {'a full fine-tune' if recipe.full_finetune else 'LoRA'} into {recipe.train_dir}{resume}")
    callbacks = [] if budget.deadline is None else [training.TimeBudget(budget.deadline)]
    if not training.train(script_args, training_args, model_args, callbacks=callbacks):
        mark(recipe, stage, STOPPED)
        print(f"[{stage}] stopped by the time budget: the newest checkpoint in {recipe.train_dir} resumes it")
        return False
    mark(recipe, stage, DONE)
    return True


def export(recipe: Recipe, budget: Budget) -> bool:
    """Stage 4: the LoRA delta (shipped.export_delta) and the merged MARS checkpoint; for the shipped base, the merge
    is shipped.build_checkpoint, the build every user of a shipped delta runs. Returns whether the stage is done."""
    stage = recipe.stages[3]
    if recipe.full_finetune or (recipe.checkpoint / "config.json").is_file():
        _skip(stage, recipe.checkpoint)  # a full fine-tune is its own MARS checkpoint
        mark(recipe, stage, DONE)
        return True
    if budget.spent():
        return _out_of_time(stage)
    delta = export_delta(recipe.train_dir, recipe.out / "delta", max_mb=float("inf"))
    size = sum(f.stat().st_size for f in delta.iterdir()) / 2**20
    if recipe.model is None:
        build_checkpoint(recipe.checkpoint, delta=delta)
    else:
        config = json.loads((delta / "adapter_config.json").read_text())
        (delta / "adapter_config.json").write_text(json.dumps(dict(config, base_model_name_or_path=recipe.model)))
        save_checkpoint(recipe.checkpoint, *merge_delta(recipe.model, delta))
    mark(recipe, stage, DONE)
    print(f"[{stage}] delta {delta} ({size:.1f} MB); merged MARS checkpoint {recipe.checkpoint}")
    return True


def evaluate(recipe: Recipe, budget: Budget) -> bool:
    """Stage 5: the τ table (evals.tau_table) of the checkpoint on GSM8K test and HumanEval, on the device, beside
    the base model's plain generate(). Returns whether the stage is done."""
    stage = recipe.stages[4]
    out = recipe.out / ("eval-full" if recipe.full_finetune else "eval-lora")
    if (out / "eval.json").is_file():
        _skip(stage, out / "eval.md")
        mark(recipe, stage, DONE)
        return True
    if budget.spent():
        return _out_of_time(stage)
    device = resolve_device(recipe.device)
    model, tokenizer = load_checkpoint(str(recipe.checkpoint), None, recipe.dtype)
    base = None
    if recipe.eval_base:
        base = AutoModelForCausalLM.from_pretrained(base_model(recipe), dtype=getattr(torch, recipe.dtype))
        base = base.to(device).eval()
    written = evaluate_and_write(
        model.to(device),
        tokenizer,
        out,
        name=recipe.checkpoint.name,
        gsm8k=recipe.eval_gsm8k,
        humaneval=recipe.eval_humaneval,
        meta=dict(dtype=recipe.dtype),
        taus=tuple(recipe.eval_taus),
        base_model=base,
        batch_size=recipe.eval_batch_size,
        max_new_tokens=recipe.max_new_tokens,
    )
    mark(recipe, stage, DONE)
    print(f"[{stage}] wrote " + ", ".join(str(path) for path in written))
    return True


def distill_stages(settings: DataSettings, budget: Budget) -> tuple[list[dict], bool]:
    """Stages 1 and 2 (what `hf-mars distill` runs): the prompts, and whether their distillation is done."""
    check_settings(settings)
    prompts = make_prompts(settings)
    return prompts, self_distill(settings, prompts, budget)


def stages_left(settings: DataSettings) -> list[str]:
    """The stages of these settings that recipe.json does not record as done."""
    record = json.loads((settings.out / "recipe.json").read_text())["stages"]
    return [stage for stage in settings.stages if record[stage] != DONE]


def run(recipe: Recipe) -> Path | None:
    """Every stage in order, each skipped when its result is there, within `recipe.time_budget`. Returns the merged
    MARS checkpoint's folder; None when the budget stopped the run (the same command continues it)."""
    budget = Budget(recipe.time_budget)
    _, done = distill_stages(recipe, budget)
    for stage in (train, export, evaluate) if recipe.with_eval else (train, export):
        done = done and stage(recipe, budget)
    return recipe.checkpoint if done else None
