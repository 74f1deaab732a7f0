"""The MARS recipe in one call, sized for one GPU: prompts → self-distillation → MARS training → export → evaluation.

Each stage writes its result under `output_dir` and is skipped when that result is there, so a re-run after an
interruption (or after a finished run) continues where the last one stopped:

1. prompts: `prompts.jsonl` and `prompts.json` (per-source counts, prompts dropped as overlapping an evaluation
   set), by `sourcing.build_prompt_mix`; done when `prompts.json` is there.
2. distill: `distilled.jsonl` (every answer; an interrupted run resumes it), `train.jsonl` (the finished answers)
   and `distill.json` (throughput, when it stopped), by `distillation.distill` and `distillation.write_training_set`
   on the device.
3. train: `mars-lora/` or `mars-full/`, by `hf-mars train` (`training.train.run`); TRL's checkpoints inside are
   resumed; done when the final save is there.
4. export: `delta/` (LoRA: the adapter and the `<|mask|>` row in float16, `shipped.export_delta`) and `checkpoint/`
   (the merged MARS checkpoint, `shipped.build_checkpoint` for the shipped base); done when `checkpoint/config.json`.
5. eval: `eval-lora/` or `eval-full/` (`eval.md`, `eval.json`, `eval.png`): the τ table of `evals.tau_table`,
   decoded on the device.

A full fine-tune's training folder is itself a MARS checkpoint (remote code included): the export stage has nothing
to do and `checkpoint` is `mars-full/`. The settings that define the data (prompts, sources, seed, base model,
answer length) are kept in `recipe.json`; a re-run with other values is refused instead of mixing two runs.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..training import train as training
from .distillation import distill, write_training_set
from .evals import evaluate_and_write
from .loading import load_checkpoint
from .shipped import base_checkpoint, build_checkpoint, export_delta, merge_delta, save_checkpoint
from .sourcing import build_prompt_mix

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DATA_SETTINGS = ("prompts", "sources", "seed", "model", "max_new_tokens")


@dataclass
class Recipe:
    """Every setting of a recipe run; the defaults are sized for one GPU, with 512-token answers (docs/recipe.md)."""

    output_dir: str
    prompts: int = 100_000
    sources: list[str] | None = None  # data.parse_sources; None: the default mix
    seed: int = 0
    model: str | None = None  # the base model's folder; None: the shipped checkpoint's base, SmolLM2-135M-Instruct
    device: str = "auto"  # auto: cuda when there is one, else cpu
    dtype: str = "bfloat16"
    max_new_tokens: int = 512
    distill_batch_size: int | None = None  # None: 512 on a GPU, 16 on a CPU
    time_budget: float | None = None  # seconds of self-distillation; None: every prompt
    full_finetune: bool = False
    epochs: float = 2.0
    batch_size: int = 32
    learning_rate: float | None = None  # None: 4e-4 with LoRA, 1e-4 for a full fine-tune
    max_length: int | None = None  # None: max_new_tokens + 512 (room for the prompt)
    block_size: int = 4
    train_args: list[str] = field(default_factory=list)  # more `hf-mars train` (TRL) arguments, appended last
    eval_gsm8k: int = 256
    eval_humaneval: int = 164
    eval_taus: tuple[float, ...] = (1.0, 0.95, 0.9, 0.8, 0.7)
    eval_batch_size: int = 64
    eval_base: bool = True  # also score the base model with plain generate()

    @classmethod
    def from_args(cls, args, **overrides) -> Recipe:
        """The settings a command line gave (`hf-mars recipe`, `hf-mars distill`): its options of the same names,
        then `overrides`."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**{**given, **overrides})

    @property
    def out(self) -> Path:
        return Path(self.output_dir)

    @property
    def train_dir(self) -> Path:
        return self.out / ("mars-full" if self.full_finetune else "mars-lora")

    @property
    def checkpoint(self) -> Path:
        return self.train_dir if self.full_finetune else self.out / "checkpoint"


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch sees no CUDA device here (use --device cpu)")
    return device


def base_model(recipe: Recipe) -> str:
    """The base model's folder: `recipe.model`, else the shipped checkpoint's base (built from its GGUF once)."""
    if recipe.model is not None:
        if not (Path(recipe.model) / "config.json").is_file():
            raise FileNotFoundError(f"--model {recipe.model}: no config.json there (pass a saved model's folder)")
        return recipe.model
    return str(base_checkpoint())


def check_settings(recipe: Recipe) -> None:
    """Record the data-defining settings in recipe.json on the first run; refuse a re-run that changes them."""
    path = recipe.out / "recipe.json"
    settings = {key: getattr(recipe, key) for key in DATA_SETTINGS}
    if path.is_file():
        before = json.loads(path.read_text())["data"]
        changed = [f"{k} {before.get(k)!r} -> {v!r}" for k, v in settings.items() if before.get(k) != v]
        if changed:
            raise ValueError(
                f"{recipe.out} holds a run made with other settings ({'; '.join(changed)}): "
                "use another --output-dir, or the same settings to continue it"
            )
        return
    recipe.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"data": settings, "all": asdict(recipe)}, indent=2, default=list))


def _skip(stage: str, path: Path) -> None:
    print(f"[{stage}] done already: {path}")


def make_prompts(recipe: Recipe) -> list[dict]:
    """Stage 1: the decontaminated prompt mix (sourcing.build_prompt_mix), as prompts.jsonl and a report."""
    path, report_path = recipe.out / "prompts.jsonl", recipe.out / "prompts.json"
    if report_path.is_file():
        _skip("prompts", path)
        return [json.loads(line) for line in path.open()]
    prompts, report = build_prompt_mix(recipe.prompts, recipe.sources, recipe.seed)
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    report_path.write_text(json.dumps(report, indent=2))
    dropped = sum(report["dropped_overlapping"].values())
    print(
        f"[prompts] {len(prompts)} prompts from {len(report['counts'])} sources; {dropped} dropped for sharing a "
        f"word {report['ngram']}-gram with GSM8K test or HumanEval: {path}"
    )
    return prompts


def self_distill(recipe: Recipe, prompts: list[dict]) -> dict:
    """Stage 2: the base model answers the prompts (distillation.distill) on the device; train.jsonl keeps finished
    answers."""
    done = recipe.out / "distill.json"
    if done.is_file():
        _skip("distill", recipe.out / "train.jsonl")
        return json.loads(done.read_text())
    device = resolve_device(recipe.device)
    base = base_model(recipe)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, recipe.dtype)).to(device).eval()
    batch = recipe.distill_batch_size or (512 if device.startswith("cuda") else 16)
    stats = distill(
        model,
        tokenizer,
        prompts,
        recipe.out / "distilled.jsonl",
        max_new_tokens=recipe.max_new_tokens,
        batch_size=batch,
        time_budget=recipe.time_budget,
    )
    kept, total = write_training_set(recipe.out / "distilled.jsonl", recipe.out / "train.jsonl")
    if not kept:
        raise ValueError(
            f"none of the {total} answers finished within {recipe.max_new_tokens} tokens: nothing to train on; "
            "run again with a larger --max-new-tokens and another --output-dir"
        )
    stats.update(kept=kept, total=total, device=device, batch_size=batch)
    done.write_text(json.dumps(stats, indent=2))
    rate = stats["new_tokens"] / max(stats["seconds"], 1e-9)
    print(
        f"[distill] {stats['answered']} prompts answered in {stats['seconds']:.0f} s ({rate:.0f} new tokens/s, "
        f"stopped: {stats['stopped']}); {kept} of {total} answers finished within {recipe.max_new_tokens} tokens"
    )
    return stats


def train_arguments(recipe: Recipe, base: str, device: str) -> list[str]:
    """The `hf-mars train` command line of this recipe."""
    lr = recipe.learning_rate or (1e-4 if recipe.full_finetune else 4e-4)
    args = ["--model_name_or_path", base, "--dataset_name", str(recipe.out / "train.jsonl")]
    args += ["--output_dir", str(recipe.train_dir), "--mars_block_size", str(recipe.block_size)]
    args += ["--num_train_epochs", str(recipe.epochs), "--per_device_train_batch_size", str(recipe.batch_size)]
    args += ["--learning_rate", str(lr), "--lr_scheduler_type", "cosine", "--warmup_steps", "0.03"]
    args += ["--max_length", str(recipe.max_length or recipe.max_new_tokens + 512)]
    args += ["--bf16", str(recipe.dtype == "bfloat16").lower(), "--activation_checkpointing", "false"]
    args += ["--logging_steps", "10", "--report_to", "none"]
    args += ["--save_strategy", "steps", "--save_steps", "200", "--save_total_limit", "2", "--seed", str(recipe.seed)]
    if not recipe.full_finetune:
        args += ["--use_peft", "--lora_r", "32", "--lora_alpha", "64", "--lora_target_modules", *LORA_TARGETS]
    if device == "cpu":
        args += ["--use_cpu"]
    if any(recipe.train_dir.glob("checkpoint-*")):
        args += ["--resume_from_checkpoint", "true"]
    return args + list(recipe.train_args)


def _trained(recipe: Recipe) -> bool:
    """The training stage's final save is there (checkpoints inside the folder do not count)."""
    if recipe.full_finetune:
        return (recipe.train_dir / "config.json").is_file() and any(recipe.train_dir.glob("*.safetensors"))
    return (recipe.train_dir / "mars.json").is_file()  # written after the adapter


def train(recipe: Recipe) -> Path:
    """Stage 3: `hf-mars train` on train.jsonl, LoRA (rank 32, every linear layer) or a full fine-tune."""
    if _trained(recipe):
        _skip("train", recipe.train_dir)
        return recipe.train_dir
    args = train_arguments(recipe, base_model(recipe), resolve_device(recipe.device))
    print(f"[train] hf-mars train {shlex.join(args)}")
    training.run(args)
    return recipe.train_dir


def export(recipe: Recipe) -> Path:
    """Stage 4: the LoRA delta (shipped.export_delta) and the merged MARS checkpoint; for the shipped base, the merge
    is shipped.build_checkpoint, the build every user of a shipped delta runs."""
    if recipe.full_finetune:
        print(f"[export] a full fine-tune is its own MARS checkpoint: {recipe.checkpoint}")
        return recipe.checkpoint
    if (recipe.checkpoint / "config.json").is_file():
        _skip("export", recipe.checkpoint)
        return recipe.checkpoint
    delta = export_delta(recipe.train_dir, recipe.out / "delta", max_mb=float("inf"))
    size = sum(f.stat().st_size for f in delta.iterdir()) / 2**20
    if recipe.model is None:
        build_checkpoint(recipe.checkpoint, delta=delta)
    else:
        config = json.loads((delta / "adapter_config.json").read_text())
        (delta / "adapter_config.json").write_text(json.dumps(dict(config, base_model_name_or_path=recipe.model)))
        save_checkpoint(recipe.checkpoint, *merge_delta(recipe.model, delta))
    print(f"[export] delta {delta} ({size:.1f} MB); merged MARS checkpoint {recipe.checkpoint}")
    return recipe.checkpoint


def evaluate(recipe: Recipe) -> Path:
    """Stage 5: the τ table (evals.tau_table) of the checkpoint on GSM8K test and HumanEval, on the device, beside
    the base model's plain generate()."""
    out = recipe.out / ("eval-full" if recipe.full_finetune else "eval-lora")
    if (out / "eval.json").is_file():
        _skip("eval", out / "eval.md")
        return out
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
        taus=recipe.eval_taus,
        base_model=base,
        batch_size=recipe.eval_batch_size,
        max_new_tokens=recipe.max_new_tokens,
    )
    print("[eval] wrote " + ", ".join(str(path) for path in written))
    return out


def run(recipe: Recipe) -> Path:
    """Every stage in order, each skipped when its result is there. Returns the merged MARS checkpoint's folder."""
    check_settings(recipe)
    prompts = make_prompts(recipe)
    self_distill(recipe, prompts)
    train(recipe)
    export(recipe)
    if recipe.eval_gsm8k or recipe.eval_humaneval:
        evaluate(recipe)
    return recipe.checkpoint
