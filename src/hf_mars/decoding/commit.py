"""What a pass keeps, for a prompt's pass (`session.py`) and the graph pass alike: how many of its tokens each
row takes (EOS and the length limit), those tokens written into the row's text, and τ-mode's next pending tokens.

This file is copied into MARS checkpoints (trust_remote_code).
"""

from __future__ import annotations

import torch


def cut(tokens, accepted, left, idle, eos):
    """`(accepted, ended)`: what each row takes of `tokens[:, :accepted]`, stopped by the `left` tokens its budget
    allows and by the first of the `eos` ids; `idle` rows (no longer decoding) take nothing."""
    accepted = torch.minimum(accepted, left).masked_fill_(idle, 0)
    ended = accepted >= left
    if eos.numel():  # the tokens before each row's first EOS: a row that takes an EOS ends with it
        before = torch.cummin(~torch.isin(tokens, eos), dim=1).values.sum(dim=1)
        hit = before < accepted
        accepted, ended = torch.minimum(accepted, before + 1), ended | hit
    return accepted, ended


def write_taken(sequences, rows, columns, tokens, untaken, pad_token_id) -> None:
    """Write a pass's `tokens` into the text of `rows` (a column) at `columns` (`(rows, tokens)`: where each row's text
    ends, on), those a row does not take (`untaken`) as padding, which a later pass writes over."""
    sequences.index_put_((rows, columns), tokens.masked_fill(untaken, pad_token_id))


def right_align(tokens, counts, width: int, pad_token_id):
    """The first `counts[i]` tokens of each row, right-aligned (left-padded) to `width`: `(tokens, real)`, as a
    left-padded prompt is."""
    index = torch.arange(width, device=tokens.device) + (counts - width)[:, None]
    real = index >= 0
    return tokens.gather(1, index.clamp(min=0)).masked_fill(~real, pad_token_id), real
