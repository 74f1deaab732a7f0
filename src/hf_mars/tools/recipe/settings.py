"""The settings of `hf-mars recipe` and `hf-mars distill`, each written once here with its default and its help.

TRL's `TrlParser` reads them (`--config recipe.yaml`, then command-line options over it; `--output-dir` and
`--output_dir` alike), and `tools.recipe` runs the stages on them. Standard library only: `hf-mars distill --help`
must not wait for torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

STOPPED = "stopped (time budget)"
NOT_STARTED = "not started"
DONE = "done"


def _help(text: str, **more) -> dict:
    return {"help": text, **more}


@dataclass
class DataSettings:
    """The prompt mix and the self-distillation: the recipe's first two stages, with the GPU recipe's defaults."""

    output_dir: str = field(metadata=_help("every stage's results, and recipe.json (the settings, what is done)"))
    prompts: int = field(default=100_000, metadata=_help("training prompts in the mix"))
    sources: list[str] | None = field(
        default=None,
        metadata=_help(
            "prompt sources and their shares, e.g. math=0.4 mbpp gym (gym:TASK for one reasoning-gym task; sciq and "
            "coqa_nc are non-commercial, opt-in); unset: the mix in docs/recipe.md",
            metavar="NAME[=SHARE]",
        ),
    )
    seed: int = field(default=0, metadata=_help("seed of the prompt mix and of training"))
    model: str | None = field(
        default=None, metadata=_help("base model folder; unset: the shipped checkpoint's base, SmolLM2-135M")
    )
    device: str = field(default="auto", metadata=_help("auto (cuda when there is one), cuda, cuda:1, cpu"))
    dtype: Literal["float32", "bfloat16"] = field(default="bfloat16", metadata=_help("dtype of every stage"))
    max_new_tokens: int = field(default=512, metadata=_help("longest answer kept"))
    distill_batch_size: int | None = field(
        default=None, metadata=_help("prompts per generate(); unset: 512 on a GPU, 16 on a CPU")
    )
    time_budget: float | None = field(
        default=None,
        metadata=_help(
            "seconds for this run: each stage stops at a clean point when they are spent, and the same command "
            "(also in a copy of --output-dir on another machine) continues it; unset: no limit"
        ),
    )

    def __post_init__(self):
        """One-line refusals of values that would fail deep inside a stage."""
        for name in ("prompts", "max_new_tokens", "distill_batch_size", "batch_size", "max_length", "block_size"):
            value = getattr(self, name, None)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.time_budget is not None and not self.time_budget > 0:
            raise ValueError(f"--time-budget must be positive, got {self.time_budget}")

    @property
    def out(self) -> Path:
        return Path(self.output_dir)

    @property
    def stages(self) -> tuple[str, ...]:
        """The stages these settings run, as `recipe.json` names them."""
        return ("prompts", "distill")


def _default(name: str, default):
    """`DataSettings`'s field `name` with another default, its help kept."""
    return field(default=default, metadata=DataSettings.__dataclass_fields__[name].metadata)


@dataclass
class DistillSettings(DataSettings):
    """`hf-mars distill`: the recipe's first two stages with the CPU recipe's defaults."""

    output_dir: str = _default("output_dir", "outputs/recipe")
    prompts: int = _default("prompts", 1000)
    max_new_tokens: int = _default("max_new_tokens", 192)
    distill_batch_size: int | None = _default("distill_batch_size", 40)
    references: bool = field(
        default=False,
        metadata=_help("also write train_reference.jsonl: the same prompts, answered by the datasets' references"),
    )


@dataclass
class Recipe(DataSettings):
    """Every setting of a recipe run; the defaults are sized for one GPU, with 512-token answers (docs/recipe.md)."""

    full_finetune: bool = field(default=False, metadata=_help("train every weight, instead of LoRA rank 32"))
    epochs: float = field(default=2.0, metadata=_help("training epochs"))
    batch_size: int = field(default=32, metadata=_help("examples per training step"))
    learning_rate: float | None = field(
        default=None, metadata=_help("unset: 4e-4 with LoRA, 1e-4 for a full fine-tune")
    )
    max_length: int | None = field(
        default=None, metadata=_help("tokens per training example; unset: --max-new-tokens + 512")
    )
    block_size: int = field(default=4, metadata=_help("B, the masks predicted per pass"))
    train_args: str = field(
        default="",
        metadata=_help('more hf-mars train (TRL) arguments, one string, over the recipe\'s: "--save_steps 500"'),
    )
    eval_gsm8k: int = field(default=256, metadata=_help("first N GSM8K test problems (0 and 0: no eval)"))
    eval_humaneval: int = field(default=164, metadata=_help("first N HumanEval problems"))
    eval_taus: list[float] = field(
        default_factory=lambda: [1.0, 0.95, 0.9, 0.8, 0.7], metadata=_help("the τ values of the table")
    )
    eval_batch_size: int = field(default=64, metadata=_help("prompts decoded together in the eval"))
    eval_base: bool = field(
        default=True, metadata=_help("also score the base model's plain generate() (--no-eval-base: do not)")
    )

    @property
    def train_dir(self) -> Path:
        return self.out / ("mars-full" if self.full_finetune else "mars-lora")

    @property
    def checkpoint(self) -> Path:
        return self.train_dir if self.full_finetune else self.out / "checkpoint"

    @property
    def with_eval(self) -> bool:
        return bool(self.eval_gsm8k or self.eval_humaneval)

    @property
    def stages(self) -> tuple[str, ...]:
        """LoRA runs `train`, `export`, `eval`; a full fine-tune (beside it, in the same folder) `train-full`..."""
        suffix = "-full" if self.full_finetune else ""
        later = ("train", "export", "eval") if self.with_eval else ("train", "export")
        return super().stages + tuple(stage + suffix for stage in later)
