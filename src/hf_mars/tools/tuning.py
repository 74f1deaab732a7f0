"""Tuning: lossless draft trees measured side by side with plain decoding (`bench.run_benchmark`). What each tree
earns (tokens per forward) belongs to the checkpoint and is saved as its `mars_acceptance`, from which
`mars_lossless="auto"` picks a tree on each machine; the fastest tree here can also be saved as this machine's
`mars_lossless` preset."""

from __future__ import annotations

from pathlib import Path

from transformers import GenerationConfig

from ..decoding.costs import check_acceptance, tree_key
from ..decoding.generate import mars_settings
from .bench import Cell, run_benchmark
from .trees import TUNE_TREES, tree_name


def tune_lossless(
    model,
    tokenizer,
    prompts,
    trees=TUNE_TREES,
    taus=(0.0,),
    batch_size: int = 1,
    max_new_tokens: int = 96,
    repeats: int = 1,
    progress: bool = True,
) -> tuple[dict, Cell, list[Cell]]:
    """Find the fastest lossless draft tree for this model and machine: `(best, fastest, cells)`.

    Runs plain `generate()` and lossless mode with the model's current default tree and with each `(B, n, L)` of
    `trees` at each τ, on `prompts`, at `batch_size`, side by side (`run_benchmark`, mask cost 0). `best` is the
    `mars_lossless` entry of the fastest (`save_lossless_preset` writes it into a checkpoint for that batch size, where
    `generate(mars_verify=True)` reads it), `fastest` its measurement, `cells` all of them, to print. Lossless mode's
    text is the same for every tree (up to rounding), so speed alone decides.
    """
    cells = run_benchmark(
        model,
        tokenizer,
        prompts,
        taus=taus,
        batch_sizes=(batch_size,),
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        verify=True,
        prompt_lookup=0,
        mask_costs=(0.0,),
        progress=progress,
        trees=trees,
        tau_mode=False,
    )
    presets, keys = {}, ("mars_tau", "mars_block_size", "mars_draft_candidates", "mars_lookup")
    for tau in taus:
        default = mars_settings(model, None, batch_size, mars_tau=tau, mars_verify=True)
        presets[f"lossless tau={tau}"] = {key: default[key] for key in keys}
        for block, n, lookup in trees:
            presets[f"lossless {tree_name(block, n, lookup)} tau={tau}"] = dict(
                mars_tau=tau, mars_block_size=block, mars_draft_candidates=n, mars_lookup=lookup
            )
    fastest = max((c for c in cells if c.method in presets), key=lambda c: c.speedup)
    return presets[fastest.method], fastest, cells


def save_lossless_preset(folder: str | Path, preset: dict, batch_size: int = 1) -> Path:
    """Write `preset` into the checkpoint folder's generation config as `mars_lossless`'s entry for `batch_size`: its
    lossless defaults from that batch size up. Entries for other batch sizes stay; a flat one counts as batch 1's."""

    folder = Path(folder)
    config = _generation_config(folder)
    entries = getattr(config, "mars_lossless", None) or {}
    entries = {} if entries == "auto" else entries  # a preset for this machine replaces the choice by costs
    if entries and not all(str(key).isdigit() for key in entries):
        entries = {"1": entries}
    config.mars_lossless = {**entries, str(batch_size): dict(preset)}
    config.save_pretrained(folder)
    return folder / "generation_config.json"


def acceptance(cells: list[Cell], trees, tau: float = 0.0) -> dict[str, float]:
    """Tokens per forward of each of `trees` at `tau` (`tune_lossless`'s cells), as `mars_acceptance`: a property of
    the checkpoint and the prompts, the same on any machine (up to rounding)."""
    by_method = {cell.method: cell for cell in cells}
    return {
        tree_key(*tree): round(by_method[f"lossless {tree_name(*tree)} tau={tau}"].tokens_per_forward, 3)
        for tree in trees
    }


def save_acceptance(folder: str | Path, measured: dict[str, float], auto: bool = False) -> Path:
    """Merge `measured` into the checkpoint folder's `mars_acceptance` (trees measured before stay); with `auto`, set
    `mars_lossless="auto"`, so that each machine picks its tree from them (a checkpoint for others to download)."""
    config = _generation_config(folder)
    config.mars_acceptance = check_acceptance({**(getattr(config, "mars_acceptance", None) or {}), **measured})
    if auto:
        config.mars_lossless = "auto"
    config.save_pretrained(folder)
    return Path(folder) / "generation_config.json"


def _generation_config(folder: str | Path) -> GenerationConfig:
    if not (Path(folder) / "generation_config.json").is_file():
        raise FileNotFoundError(f"{folder} has no generation_config.json: pass a local MARS checkpoint folder.")
    return GenerationConfig.from_pretrained(folder)
