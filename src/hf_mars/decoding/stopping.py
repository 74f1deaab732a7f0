"""Stopping criteria under MARS, exactly as `generate()` calls them.

`generate()` calls its stopping criteria once per step with the whole batch in its original order: every row's
prompt and its first n tokens, rows that finished earlier padded. Criteria may keep state per row (lm-eval's
`MultiTokenEOSCriteria` does), so MARS makes the same calls with the same tensors, in the same order. Rows of a
MARS batch run at different speeds, so step n is judged once every row still decoding has a token at step n; a row
that runs ahead keeps decoding meanwhile, and what it decoded past the step where a criterion stops it is dropped.

EOS and the length limit are judged by each row alone, without calling anything, when they are the only criteria
(the common case): those two criteria read nothing but the row itself, so the verdicts are the same.
"""

from __future__ import annotations

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria


class Stopping:
    """Which rows have stopped, and after how many new tokens, as `generate()`'s stopping criteria decide.

    As in `generate()`, a finished row continues as padding only when a criterion stops at EOS; without one, it goes
    on generating until the whole batch has finished.

    Attributes:
        unfinished (`(batch,)` bool): rows the criteria have not stopped.
        new_tokens (`(batch,)` long): each row's new tokens that the criteria have seen and kept.
    """

    def __init__(self, criteria, sequences: torch.Tensor, prompt_length: int, pad_token_id: int):
        self.criteria = criteria
        self.per_row = all(isinstance(c, (MaxLengthCriteria, EosTokenCriteria)) for c in criteria)
        self.pads = any(hasattr(c, "eos_token_id") for c in criteria)  # generate()'s test
        self.sequences, self.prompt_length, self.pad_token_id = sequences, prompt_length, pad_token_id
        batch, device = sequences.shape[0], sequences.device
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        self.new_tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.judged = 0  # steps the criteria have been called for (lockstep)

    @property
    def settled(self) -> torch.Tensor:
        """`(batch,)`: rows whose output is final, which need decode no more."""
        return ~self.unfinished if self.pads else (~self.unfinished).all().expand_as(self.unfinished)

    def judge(self, decoded: torch.Tensor, ended: torch.Tensor) -> None:
        """After a pass: rows hold `decoded` new tokens in `sequences`; `ended` rows decode no more (they hit EOS or
        the length limit, where the criteria will stop them)."""
        if self.per_row:
            self.new_tokens = torch.where(self.unfinished, decoded, self.new_tokens)
            self.unfinished &= ~ended
            return
        open_rows = ~self.settled
        decoding = open_rows & ~ended
        if bool(decoding.any()):  # the slowest row still decoding holds the rest back
            ready = int(decoded[decoding].min())
        else:
            ready = int(decoded[open_rows].max()) if bool(open_rows.any()) else self.judged
        for step in range(self.judged + 1, ready + 1):
            if not bool(self.unfinished.any()):
                break
            self._call(step)
            self.judged = step

    def _call(self, step: int) -> None:
        """`generate()`'s call at `step`: the whole batch, each row's prompt and first `step` tokens."""
        width = self.prompt_length + step
        stop = self.criteria(self.sequences[:, :width], None).to(self.unfinished.device)
        newly = self.unfinished & stop
        # a finished row keeps its length where it turns into padding, else it grows with the batch
        self.new_tokens = (
            torch.where(self.unfinished, step, self.new_tokens)
            if self.pads
            else torch.full_like(self.new_tokens, step)
        )
        self.unfinished &= ~stop
        if self.pads and bool(newly.any()):  # a finished row continues as padding
            self.sequences[newly, width:] = self.pad_token_id


def stream(streamer, sequences: torch.Tensor, prompt_length: int, streamed: int, kept: int) -> int:
    """Hand `streamer` row 0's new tokens (a streamer takes one sequence) from the `streamed`-th to the `kept`-th: what
    the criteria kept since the last pass, as one chunk. Returns `kept`, what has now been streamed."""
    streamer.put(sequences[0, prompt_length + streamed : prompt_length + kept].cpu())
    return kept
