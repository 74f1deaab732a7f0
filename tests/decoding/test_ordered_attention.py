"""`ordered` attention: a query's output is the same bits whatever else the pass's tensors hold.

What a lossless pass changes around a token, against the one-token step that plain decoding runs for it: the queries
beside it (the pass's other tokens), keys it does not see (the pass's later tokens, a tree's other branches, a static
cache's empty slots, a batch's left padding) and the rows beside it. Each is held to bitwise equality here, in
bfloat16 and float32, on the attention function itself (whatever this CPU's matrix kernels do), then on a model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import make_model, make_tokenizer, rows_invariant_linear, toy_prompts
from transformers import DynamicCache, GenerationMixin

import hf_mars
from hf_mars.decoding.compat import CACHE_ARG
from hf_mars.decoding.ordered_attention import ordered_attention
from hf_mars.decoding.ordered_linear import OrderedLinear

HEADS, KV_HEADS, DIM = 6, 2, 16


def _attend(query, key, value, mask):
    return ordered_attention(None, query, key, value, mask, scaling=DIM**-0.5)[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_query_gets_the_same_bits_alone_in_a_wide_pass_and_beside_unseen_keys(dtype):
    torch.manual_seed(0)
    context, width = 37, 9
    query = torch.randn(1, HEADS, width, DIM).to(dtype)
    key, value = (torch.randn(1, KV_HEADS, context + width, DIM).to(dtype) for _ in range(2))
    causal = torch.ones(width, context + width, dtype=torch.bool).tril(diagonal=context)[None, None]
    wide = _attend(query, key, value, causal)  # (1, width, heads, dim)
    for i in range(width):  # the one-token step: its context and itself, no more
        seen = context + i + 1
        step = _attend(query[:, :, i : i + 1], key[:, :, :seen], value[:, :, :seen], None)
        assert torch.equal(step[0, 0], wide[0, i])
    # holes among the keys (a tree's other branches, rejected drafts): the same as the keys without them
    holes = torch.ones(1, 1, 1, context + width, dtype=torch.bool)
    holes[..., [3, 10, 11, context + 2]] = False
    holes[..., context + 4 :] = False  # and a static cache's empty slots after
    kept = holes[0, 0, 0].nonzero().squeeze(1)
    spread = _attend(query[:, :, :1], key, value, holes)
    packed = _attend(query[:, :, :1], key[:, :, kept], value[:, :, kept], None)
    assert torch.equal(spread, packed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_gets_the_same_bits_alone_and_in_a_padded_batch(dtype):
    torch.manual_seed(1)
    query = torch.randn(3, HEADS, 4, DIM).to(dtype)
    key, value = (torch.randn(3, KV_HEADS, 20, DIM).to(dtype) for _ in range(2))
    mask = torch.ones(3, 1, 4, 20, dtype=torch.bool)
    mask[1, ..., :7] = False  # left padding
    mask[2, ..., 15:] = False
    batched = _attend(query, key, value, mask)
    for row in range(3):
        alone = _attend(query[row : row + 1], key[row : row + 1], value[row : row + 1], mask[row : row + 1])
        assert torch.equal(alone[0], batched[row])
    assert torch.equal(_attend(query[1:2], key[1:2, :, 7:], value[1:2, :, 7:], None), batched[1:2])


def test_a_fully_masked_row_stays_finite():
    """Padding queries see no key: they average, as eager attention's additive mask makes them, never NaN (a NaN in
    a padding position's values would reach real queries through 0 * NaN)."""
    query, key, value = torch.randn(1, HEADS, 2, DIM), *(torch.randn(1, KV_HEADS, 5, DIM) for _ in range(2))
    out = _attend(query, key, value, torch.zeros(1, 1, 2, 5, dtype=torch.bool))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_model_with_ordered_attention_computes_a_wide_pass_as_one_token_steps(dtype):
    """A random MARS Llama: the logits of 7 tokens fed at once (and with 4 more after them, unseen) are the bits of 7
    one-token steps over the same cache, and a row's are its own in a left-padded batch. This rests on the CPU's
    products giving a row the same bits in an `ordered` model's linear layers, which the run checks first
    (`rows_invariant_linear`); in float32 those layers pad their rows where plain products would not."""
    torch.manual_seed(3)
    model = hf_mars.to_mars(make_model("llama"), make_tokenizer(), block_size=4).to(dtype)
    model.set_attn_implementation("ordered")
    ids = torch.randint(3, model.config.vocab_size, (1, 40))
    if not rows_invariant_linear(dtype):
        pytest.skip(f"this CPU's {dtype} matrix kernels round a row by the rows beside it, padded or not")
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :29], **{CACHE_ARG: cache}, use_cache=True)
        steps, stepped = [], copy.deepcopy(cache)
        for i in range(29, 36):
            steps.append(model(input_ids=ids[:, i : i + 1], **{CACHE_ARG: stepped}, use_cache=True).logits[0, -1])
        wide = model(input_ids=ids[:, 29:40], **{CACHE_ARG: copy.deepcopy(cache)}, use_cache=True).logits[0, :7]
        assert torch.equal(torch.stack(steps), wide)
        batch = torch.stack([ids[0, :30], torch.cat([ids[0, :4] * 0, ids[0, 4:30]])])
        attention = torch.ones_like(batch)
        attention[1, :4] = 0
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        batched = model(input_ids=batch, attention_mask=attention, position_ids=positions).logits
        assert torch.equal(batched[0], model(input_ids=ids[:, :30]).logits[0])
        assert torch.equal(batched[1, 4:], model(input_ids=ids[:, 4:30]).logits[0])


def test_ordered_attention_orders_the_linear_layers_and_sdpa_gives_them_back():
    """The MARS classes swap `nn.Linear` for `OrderedLinear` (same parameters, same state dict) at the first forward
    after the attention becomes `ordered`, and back after it leaves; whatever made the model (here `to_mars`)."""
    model = hf_mars.to_mars(make_model("llama"), make_tokenizer(), block_size=4)
    keys = set(model.state_dict())
    ids = torch.tensor([[5, 6, 7]])

    def kinds():
        return {type(m) for m in model.modules() if isinstance(m, torch.nn.Linear)}

    with torch.no_grad():
        model(input_ids=ids)
        assert kinds() == {torch.nn.Linear}
        model.set_attn_implementation("ordered")
        before = model(input_ids=ids).logits
        assert kinds() == {OrderedLinear} and set(model.state_dict()) == keys
        model.set_attn_implementation("sdpa")
        model(input_ids=ids)
        assert kinds() == {torch.nn.Linear}
    assert torch.isfinite(before).all()


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def flat(request):
    """A random MARS Llama whose next-token scores lie close together (initializer_range 0.05), so that rounding
    flips choices: with `sdpa` in bfloat16 on the AVX2 CPU of docs/benchmarks.md, 3 of these 6 rows' lossless texts
    and 2 of their plain batched texts part from their batch-1 texts. `ordered` attention."""
    tok = make_tokenizer()
    model = hf_mars.to_mars(make_model("llama", initializer_range=0.05), tok, block_size=4).to(request.param)
    model.set_attn_implementation("ordered")
    return model, tok


def test_lossless_and_tau_one_give_plain_greedys_tokens_alone_and_batched(flat):
    """With `ordered` attention, lossless mode (chains, runner-ups, per-depth candidates, prompt lookup, at τ = 0
    and 0.7, dynamic and static cache) and τ = 1 give plain greedy `generate()`'s tokens bit for bit, in bfloat16
    and float32, and every row of a left-padded batch gets its own batch-1 text, plain decoding included."""
    model, tok = flat
    if not rows_invariant_linear(model.dtype):
        pytest.skip(f"this CPU's {model.dtype} matrix kernels round a row by the rows beside it, padded or not")
    enc = toy_prompts(tok, n=6, seed=7)
    alone = []
    for row in range(6):
        real = enc.attention_mask[row].bool()
        ids = enc.input_ids[row : row + 1, real]
        out = GenerationMixin.generate(model, input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=40)
        alone.append(out[0, ids.shape[1] :])

    def rows(sequences):
        return [seq[enc.input_ids.shape[1] :] for seq in sequences]

    def same(sequences, what):
        for row, (got, want) in enumerate(zip(rows(sequences), alone)):
            assert torch.equal(got[: want.numel()], want), f"{what}: row {row}"

    same(GenerationMixin.generate(model, **enc, max_new_tokens=40), "plain, batched")
    same(model.generate(**enc, mars_tau=1.0, max_new_tokens=40), "τ = 1")
    passes = {}
    for tau, candidates, lookup, cache in (
        (0.0, 1, 0, None),
        (0.0, 3, 4, None),
        (0.7, (3, 2, 2), 0, None),
        (0.0, 1, 0, "static"),
        (0.0, 3, 4, "static"),
    ):
        extra = {"cache_implementation": cache} if cache else {}
        out = model.generate(
            **enc,
            mars_verify=True,
            mars_tau=tau,
            mars_draft_candidates=candidates,
            mars_lookup=lookup,
            max_new_tokens=40,
            return_dict_in_generate=True,
            **extra,
        )
        same(out.sequences, f"lossless τ={tau}, candidates {candidates}, lookup {lookup}, {cache or 'dynamic'} cache")
        passes[tau, candidates, lookup, cache] = out.mars_stats.mean_tokens_per_forward
    assert max(passes.values()) > 1.2  # drafts were kept: wide passes were compared, not only one-token steps
