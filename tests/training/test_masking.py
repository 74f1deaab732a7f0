"""The two-stream attention layout: the mask pattern itself, and what a model computes through it."""

import pytest
import torch
from helpers import make_model

from hf_mars.training.masking import create_two_stream_mask, two_stream_position_ids

B = 3


def reference_pattern(clean_mask, noisy_mask, block_size, noisy_start):
    """The paper's pattern written out with loops: may query q attend to key k (both in `[clean | noisy]` index
    space)?"""
    batch, length = clean_mask.shape
    tail = noisy_mask.shape[1]
    total = length + tail
    out = torch.zeros(batch, total, total, dtype=torch.bool)
    for b in range(batch):
        real = clean_mask[b].tolist() + noisy_mask[b].tolist()

        def where(i, start=int(noisy_start[b])):  # (is_noisy, logical position)
            return (False, i) if i < length else (True, start + i - length)

        for q in range(total):
            q_noisy, q_pos = where(q)
            for k in range(total):
                k_noisy, k_pos = where(k)
                if not real[k]:
                    continue
                if not q_noisy and not k_noisy:
                    allowed = k_pos <= q_pos
                elif q_noisy and k_noisy:
                    allowed = k_pos // block_size == q_pos // block_size and k_pos <= q_pos
                elif q_noisy:
                    allowed = k_pos // block_size < q_pos // block_size
                else:
                    allowed = False
                out[b, q, k] = allowed
    return out


def layout(noisy_start, lengths, length):
    """Padding masks for rows of the given real lengths, with noisy tails from `noisy_start` to each row's end."""
    noisy_start = torch.tensor(noisy_start)
    lengths = torch.tensor(lengths)
    tail = int((lengths - noisy_start).max())
    clean_mask = (torch.arange(length) < lengths[:, None]).long()
    noisy_mask = (noisy_start[:, None] + torch.arange(tail) < lengths[:, None]).long()
    return clean_mask, noisy_mask, noisy_start


def tol(model):
    """float64 throughout for sdpa; eager takes its softmax in float32 whatever the model dtype."""
    return 1e-9 if model.config._attn_implementation == "sdpa" else 1e-5


def two_stream_logits(model, clean_ids, noisy_ids, clean_mask, noisy_mask, noisy_start):
    mask = create_two_stream_mask(model.config, clean_mask, noisy_mask, B, noisy_start, dtype=model.dtype)
    position_ids = two_stream_position_ids(clean_ids.shape[1], noisy_ids.shape[1], noisy_start)
    with torch.no_grad():
        ids = torch.cat([clean_ids, noisy_ids], 1)
        return model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits


def causal_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids[None]).logits[0]


CASES = {
    "s=0": ([0, 0], [11, 8]),  # the noisy stream covers the whole sequence
    "s>0": ([3, 6], [11, 8]),  # per-row tails, the second row shorter (padded)
}


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_materialised_mask_matches_reference(impl):
    model = make_model("qwen2", attn_implementation=impl)
    for starts, lengths in CASES.values():
        clean_mask, noisy_mask, noisy_start = layout(starts, lengths, 12)
        mask = create_two_stream_mask(model.config, clean_mask, noisy_mask, B, noisy_start)
        expected = reference_pattern(clean_mask, noisy_mask, B, noisy_start)
        assert mask.shape == (2, 1, *expected.shape[1:])
        if impl == "eager":  # eager adds the mask to the scores: it must be additive, never bool
            assert mask.dtype == torch.float32
            mask = mask == 0
        assert torch.equal(mask[:, 0], expected)


@pytest.fixture(params=["sdpa", "eager"])
def model(request):
    model = make_model("qwen2", dtype=torch.float64, attn_implementation=request.param)
    assert model.config._attn_implementation == request.param
    return model


def random_streams(starts, lengths, length=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    clean_mask, noisy_mask, noisy_start = layout(starts, lengths, length)
    clean_ids = torch.randint(3, 250, clean_mask.shape, generator=gen)
    noisy_ids = torch.randint(3, 250, noisy_mask.shape, generator=gen)  # any tokens: the layout is what is tested
    return clean_ids, noisy_ids, clean_mask, noisy_mask, noisy_start


@pytest.mark.parametrize("case", CASES)
def test_clean_stream_is_a_plain_causal_forward(model, case):
    clean_ids, noisy_ids, clean_mask, noisy_mask, noisy_start = random_streams(*CASES[case])
    logits = two_stream_logits(model, clean_ids, noisy_ids, clean_mask, noisy_mask, noisy_start)
    for b, n in enumerate(clean_mask.sum(1).tolist()):
        want = causal_logits(model, clean_ids[b, :n])
        torch.testing.assert_close(logits[b, :n], want, rtol=tol(model), atol=tol(model))


@pytest.mark.parametrize("case", CASES)
def test_noisy_blocks_match_brute_force(model, case):
    """Noisy block k = a plain causal forward over [clean blocks < k | that block's noisy tokens]."""
    clean_ids, noisy_ids, clean_mask, noisy_mask, noisy_start = random_streams(*CASES[case])
    length = clean_ids.shape[1]
    logits = two_stream_logits(model, clean_ids, noisy_ids, clean_mask, noisy_mask, noisy_start)
    checked = 0
    for b in range(len(clean_ids)):
        start, end = int(noisy_start[b]), int(clean_mask[b].sum())
        for block_start in range(start, end, B):
            block = slice(block_start - start, min(block_start + B, end) - start)  # tail columns of this block
            ids = torch.cat([clean_ids[b, :block_start], noisy_ids[b, block]])
            expected = causal_logits(model, ids)[block_start:]
            got = logits[b, length + block.start : length + block.stop]
            torch.testing.assert_close(got, expected, rtol=tol(model), atol=tol(model))
            checked += 1
    assert checked >= 4  # the loop did run over several blocks


def test_noisy_block_sees_only_earlier_clean_blocks(model):
    starts, lengths = [0, 0], [12, 12]
    clean_ids, noisy_ids, clean_mask, noisy_mask, noisy_start = random_streams(starts, lengths)
    length = clean_ids.shape[1]
    base = two_stream_logits(model, clean_ids, noisy_ids, clean_mask, noisy_mask, noisy_start)
    k = 1  # noisy block 1 = positions 3..5; it may see clean block 0 only, not its own clean block

    def noisy_block_logits(ids):
        logits = two_stream_logits(model, ids, noisy_ids, clean_mask, noisy_mask, noisy_start)
        return logits[:, length : length + (k + 1) * B]  # noisy blocks 0..k

    for position in range(k * B, length):  # clean tokens of block k or later
        changed = clean_ids.clone()
        changed[:, position] = (changed[:, position] + 1) % 250
        torch.testing.assert_close(noisy_block_logits(changed), base[:, length : length + (k + 1) * B], rtol=0, atol=0)
        # ... while a change in clean block k + 1 reaches block k + 2, which sees it
        if (k + 1) * B <= position < (k + 2) * B:
            later = two_stream_logits(model, changed, noisy_ids, clean_mask, noisy_mask, noisy_start)
            assert not torch.allclose(later[:, length + (k + 2) * B], base[:, length + (k + 2) * B])
    for position in range(k * B):  # clean tokens of an earlier block
        changed = clean_ids.clone()
        changed[:, position] = (changed[:, position] + 1) % 250
        new = noisy_block_logits(changed)[:, k * B :]
        assert not torch.allclose(new, base[:, length + k * B : length + (k + 1) * B])


@pytest.mark.slow  # torch.compile of the BlockMask: ~54 s with a cold inductor cache (CI), ~10 s warm
def test_flex_attention_block_mask():
    """flex on CPU runs through a BlockMask (compiled once, so this test takes a few seconds)."""
    from torch.nn.attention.flex_attention import BlockMask

    starts, lengths = CASES["s>0"]
    clean_ids, noisy_ids, clean_mask, noisy_mask, noisy_start = random_streams(starts, lengths)
    flex = make_model("qwen2", attn_implementation="flex_attention")
    mask = create_two_stream_mask(flex.config, clean_mask, noisy_mask, B, noisy_start)
    assert isinstance(mask, BlockMask)
    total = clean_ids.shape[1] + noisy_ids.shape[1]
    idx = torch.arange(total)
    dense = mask.mask_mod(
        torch.arange(2)[:, None, None, None],
        torch.zeros(1, 1, 1, 1, dtype=torch.long),
        idx[None, None, :, None],
        idx[None, None, None, :],
    )
    want = reference_pattern(clean_mask, noisy_mask, B, noisy_start)
    assert torch.equal(dense.expand(2, 1, total, total)[:, 0], want)
    sdpa = make_model("qwen2", attn_implementation="sdpa")
    got = two_stream_logits(flex, clean_ids, noisy_ids, clean_mask, noisy_mask, noisy_start)
    want = two_stream_logits(sdpa, clean_ids, noisy_ids, clean_mask, noisy_mask, noisy_start)
    real = torch.cat([clean_mask, noisy_mask], 1).bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-4)


def test_unsupported_attention_is_refused():
    model = make_model("qwen2", attn_implementation="sdpa")
    model.config._attn_implementation = "flash_attention_2"
    clean_mask, noisy_mask, noisy_start = layout([0, 0], [6, 6], 6)
    with pytest.raises(ValueError, match="attention implementation"):
        create_two_stream_mask(model.config, clean_mask, noisy_mask, B, noisy_start)
