"""Tuning: lossless draft trees measured side by side with plain decoding (`bench.run_benchmark`). What each tree
earns (tokens per forward) belongs to the checkpoint and is saved as its `mars_acceptance`, from which
`mars_lossless="auto"` picks a tree on each machine; the fastest tree here can also be saved as this machine's
`mars_lossless` preset.

Which trees to measure comes from the checkpoint too: how often the true next token is among each mask depth's top k
(`depth_ranks`) says what runner-ups at that depth would earn, so `propose_trees` finds, for each pass width, the
per-depth candidate counts with the most expected tokens per forward (as EAGLE-2 and Medusa shape their trees).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, GenerationMixin

from ...decoding.compat import supports_logits_to_keep
from ...decoding.costs import check_acceptance, pass_width, tree_key
from ...decoding.generate import mars_settings
from ...decoding.settings import CALL_KEYS
from ...decoding.tree import canonical_candidates
from .bench import Cell, run_benchmark
from .decode import static_compiled
from .trees import TUNE_TREES


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
    compiled: bool = False,
) -> tuple[dict, Cell, list[Cell]]:
    """Find the fastest lossless draft tree for this model and machine: `(best, fastest, cells)`.

    Runs plain `generate()` and lossless mode with the model's current default tree and with each `(B, n, L)` of
    `trees` at each τ, on `prompts`, at `batch_size`, side by side (`run_benchmark`, mask cost 0). `best` is the
    `mars_lossless` entry of the fastest (`save_lossless_preset` writes it into a checkpoint for that batch size, where
    `generate(mars_verify=True)` reads it), `fastest` its measurement, `cells` all of them, to print. Lossless mode's
    text is the same for every tree (up to rounding), so speed alone decides. `compiled`: on the path a GPU server
    runs, a static cache and `generate()`'s compile path (`run_benchmark`'s); the default tree is then the one chosen
    from compiled pass costs.
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
        compiled=compiled,
    )
    call = compiled_call(model, max_new_tokens, batch_size, trees) if compiled else {}
    presets, keys = {}, ("mars_tau", "mars_block_size", "mars_draft_candidates", "mars_lookup")
    for tau in taus:
        default = mars_settings(model, None, batch_size, mars_tau=tau, mars_verify=True, **call)
        presets[f"lossless tau={tau}"] = {key: default[key] for key in keys}
        for block, n, lookup in trees:
            presets[f"lossless {tree_key(block, n, lookup)} tau={tau}"] = dict(
                mars_tau=tau,
                mars_block_size=block,
                mars_draft_candidates=list(n) if isinstance(n, tuple) else n,  # as the saved JSON holds it
                mars_lookup=lookup,
            )
    fastest = max((c for c in cells if c.method in presets), key=lambda c: c.speedup)
    return presets[fastest.method], fastest, cells


def compiled_call(model, max_new_tokens: int, batch_size: int, trees=()) -> dict:
    """The `generate()` keywords that decide whether a call is compiled (`settings.CALL_KEYS`), as `run_benchmark`'s
    compiled calls pass them: what `mars_settings` needs to resolve those calls' settings."""
    kwargs = static_compiled(model, 1, max_new_tokens, (batch_size,), trees)
    return {name: value for name, value in kwargs.items() if name in CALL_KEYS}


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
        tree_key(*tree): round(by_method[f"lossless {tree_key(*tree)} tau={tau}"].tokens_per_forward, 3)
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


# How far down each mask's ranking `depth_ranks` looks: counts past it are never proposed
DEPTH_TOP = 8


@torch.no_grad()
def depth_ranks(model, tokenizer, prompts, max_new_tokens: int = 96, top: int = DEPTH_TOP, progress=True):
    """Where the model's own next tokens rank in its masks' predictions: `(positions, B-1)` ranks (0: the top token;
    `top`: not in the top `top`), at every position of each prompt's greedy continuation whose next B tokens are known.

    The masks that follow the text up to a position are the group a lossless pass proposes drafts from: mask d
    predicts the token d after the root's own prediction, the chain's depth-d draft. One forward per prompt
    (`ranks_along`); B is the model's.
    """
    ranks = []
    for prompt in tqdm(prompts, desc="per-depth accuracy", disable=not progress):
        ids = tokenizer(prompt["text"], add_special_tokens=False, return_tensors="pt").input_ids.to(model.device)
        text = GenerationMixin.generate(
            model, input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens
        )[0]
        ranks.append(ranks_along(model, text, ids.shape[1], top))
    return torch.cat(ranks)


@torch.no_grad()
def ranks_along(model, text, start: int, top: int = DEPTH_TOP):
    """`depth_ranks` of one text (`text[start:]` decoded greedily after `text[:start]`) in one forward: the text,
    then B-1 masks after each position t from `start - 1` on, a group that sees the text up to t and its own masks
    before it (a 4D mask of sdpa's and eager's additive form; sliding windows are not applied)."""
    masks = int(model.config.mars_block_size) - 1
    n, device = text.shape[0], text.device
    positions = torch.arange(start - 1, n - masks - 1, device=device)  # the last needs text[t + 1 + masks]
    if not positions.numel() or not masks:
        return torch.empty(0, masks, dtype=torch.long, device=device)
    width = positions.numel() * masks
    group, offset = torch.arange(width, device=device) // masks, torch.arange(width, device=device) % masks
    sees = torch.ones(n + width, n + width, dtype=torch.bool, device=device).tril()
    sees[n:, :n] = torch.arange(n, device=device) <= positions[group, None]
    sees[n:, n:] = (group[:, None] == group) & (offset <= offset[:, None])
    hidden = torch.finfo(model.dtype).min
    additive = torch.zeros(sees.shape, dtype=model.dtype, device=device).masked_fill(~sees, hidden)[None, None]
    ids = torch.cat([text, text.new_full((width,), model.config.mars_mask_token_id)])[None]
    position_ids = torch.cat([torch.arange(n, device=device), positions[group] + 1 + offset])[None]
    keep = {"logits_to_keep": width} if supports_logits_to_keep(model) else {}
    out = model(input_ids=ids, attention_mask=additive, position_ids=position_ids, use_cache=False, **keep)
    logits = out.logits[0, -width:]
    truth = text[positions[:, None] + 2 + torch.arange(masks, device=device)].view(-1, 1)
    ranks = (logits > logits.gather(1, truth)).sum(dim=1).clamp(max=top)
    return ranks.view(-1, masks)


def depth_accuracy(ranks, top: int = DEPTH_TOP) -> list[list[float]]:
    """`[d - 1][k - 1]`: the share of positions whose depth-d token is among mask d's top k."""
    k = torch.arange(1, top + 1, device=ranks.device)
    return (ranks[:, :, None] < k).float().mean(dim=0).tolist()


def chain_accuracy(ranks, top: int = DEPTH_TOP) -> list[list[float]]:
    """`[d - 1][k - 1]`: the share of positions where the chain's drafts above depth d are right and the depth-d
    token is among mask d's top k, that is where a tree with k candidates at depth d accepts its depth-d draft (its
    runner-ups are leaves, so only the chain leads deeper). Summed over depths: expected accepted drafts."""
    above = torch.cat([torch.ones_like(ranks[:, :1], dtype=torch.bool), (ranks == 0).cumprod(dim=1)[:, :-1] > 0], 1)
    k = torch.arange(1, top + 1, device=ranks.device)
    return ((ranks[:, :, None] < k) & above[:, :, None]).float().mean(dim=0).tolist()


def propose_trees(reached: list[list[float]], max_width: int) -> list[tuple[int, tuple, float]]:
    """The per-depth trees worth measuring: `[(pass width, (B, candidates, 0), expected tokens per forward)]` up to
    `max_width`, from `reached` (`chain_accuracy`). Every block size up to the measured depths + 1 and every number of
    runner-ups is tried, with the candidate counts that reach most (`best_counts`); kept are the trees that beat
    every narrower one, so the list runs from the narrowest to the widest pass, expected tokens rising."""
    options = []
    for block in range(2, len(reached) + 2):
        extra = 0
        while (block + extra) * block <= max_width:
            found = best_counts(reached[: block - 1], extra)
            if found is None:  # every depth has all the candidates measured
                break
            counts, gain = found
            tree = (block, canonical_candidates(counts), 0)
            options.append((pass_width(*tree), tree, 1.0 + gain))
            extra += 1
    frontier, best = [], 0.0
    for width, tree, tokens in sorted(options, key=lambda option: (option[0], -option[2])):
        if tokens > best + 1e-9:
            frontier.append((width, tree, round(tokens, 3)))
            best = tokens
    return frontier


def best_counts(reached: list[list[float]], extra: int) -> tuple[tuple[int, ...], float] | None:
    """Candidates per depth with `extra` runner-ups in all that maximise the expected accepted drafts,
    `sum(reached[d][k_d - 1])`: `(counts, that sum)`, or None where the measured top k cannot hold them."""
    best = {0: (0.0, ())}  # runner-ups spent so far -> (expected drafts, counts)
    for row in reached:
        options = {}
        for spent, (gain, counts) in best.items():
            for k in range(1, min(len(row), extra - spent + 1) + 1):
                total = gain + row[k - 1]
                if total > options.get(spent + k - 1, (-1.0,))[0]:
                    options[spent + k - 1] = (total, counts + (k,))
        best = options
    found = best.get(extra)
    return None if found is None else (found[1], found[0])
