"""MARS decoding: exactness anchors (τ = 1 is `generate()`), batching, the cache, stopping, streaming, errors."""

from __future__ import annotations

import pytest
import torch
from helpers import SLIDING, Recorder, make_model, make_tokenizer, sliding_mars_model, toy_prompts
from transformers import (
    GenerationMixin,
    StoppingCriteria,
)

import hf_mars
from hf_mars.decoding import schedule
from hf_mars.decoding.scoring import confidence

PROMPTS = ["hello world, how", "a", "the quick brown fox jumps"]
FAMILIES = ["qwen2", "qwen3", "llama"]


def sharp_mars_model(family="qwen2", dtype=torch.float64, block_size=4, seed=0):
    """An untrained MARS model whose head is scaled up: its confidences spread over (0, 1), so at τ in [0.5, 0.9]
    some passes accept one token and others several, which is what batching and the cache must get right."""
    tok = make_tokenizer()
    model = make_model(family, dtype=dtype, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return hf_mars.to_mars(model, tok, block_size=block_size), tok


def encode(tok, prompts=PROMPTS):
    return tok(prompts, return_tensors="pt", padding=True)


def rows_alone(model, tok, enc, **kwargs):
    """Decode each row of a padded batch on its own; return the generated tokens of each."""
    out = []
    for i in range(enc.input_ids.shape[0]):
        ids = enc.input_ids[i : i + 1, enc.attention_mask[i].bool()]
        out.append(model.generate(input_ids=ids, **kwargs)[0, ids.shape[1] :])
    return out


def strip_pad(tokens, pad_id):
    """Generated tokens of one row of a batch, without the right padding of rows that finished early."""
    keep = len(tokens)
    while keep and tokens[keep - 1] == pad_id:
        keep -= 1
    return tokens[:keep]


def naive_mars_decode(model, ids, tau, block_size, mask_id, max_new_tokens, eos_id, mask_cost=0.0):
    """The reference: no cache at all. Each pass re-runs [whole committed text | masks] from scratch, with B-1 masks,
    or (`mask_cost` > 0) the masks that the cost model of `MaskSchedule` offers, written out here one row at a time."""
    ids = list(ids)
    new = []
    most = block_size - 1
    step, recover, every = schedule.RATE_STEP, schedule.RECOVER, schedule.PROBE_EVERY
    rate, passes = [schedule.RATE_START] * most, 0
    costs = mask_cost if isinstance(mask_cost, list) else [mask_cost * k for k in range(1, most + 1)]
    while len(new) < max_new_tokens:
        masks = most
        if any(
            costs
        ):  # the k masks with the most expected tokens per unit of time, (1 + R_0 + ... + R_{k-1}) / (1 + cost_k)
            reach, cumulative, masks, best = 1.0, 0.0, 0, 1.0
            for k in range(1, most + 1):
                reach *= rate[k - 1]
                cumulative += reach
                if (1 + cumulative) / (1 + costs[k - 1]) > best:
                    masks, best = k, (1 + cumulative) / (1 + costs[k - 1])
        masks = 0 if tau >= 1 else masks
        x = torch.tensor([ids + [mask_id] * masks])
        logits = model(input_ids=x).logits[0, -(masks + 1) :].float()
        probs = logits.softmax(-1)
        tokens = logits.argmax(-1)
        conf = probs.gather(-1, tokens[:, None]).squeeze(-1)
        take = 1
        while take <= masks and conf[take] >= tau:
            take += 1
        if any(costs):
            paid = take - 1
            for j in range(most):
                if j < min(masks, paid + 1):
                    rate[j] = (1 - step) * rate[j] + step * float(j < paid)
                elif j >= masks and passes % every == 0:
                    rate[j] = rate[j] + recover * (1 - rate[j])
        passes += 1
        for t in tokens[:take].tolist():
            ids.append(t)
            new.append(t)
            if t == eos_id or len(new) == max_new_tokens:
                return new
    return new


# --- τ = 1 is exactly autoregressive decoding --------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_tau_one_equals_greedy_generate_batched_and_not(family):
    tok = make_tokenizer()
    base = make_model(family)
    mars = hf_mars.to_mars(make_model(family), tok, block_size=4)
    enc = encode(tok)
    ref = base.generate(**enc, do_sample=False, max_new_tokens=24)
    out = mars.generate(**enc, mars_tau=1.0, max_new_tokens=24, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.mars_stats.forward_passes == 24
    assert all(int(a.max()) == 1 for a in out.mars_stats.accepted_per_step)
    for i, row in enumerate(rows_alone(mars, tok, enc, mars_tau=1.0, max_new_tokens=24)):
        ids = enc.input_ids[i : i + 1, enc.attention_mask[i].bool()]
        assert torch.equal(row, base.generate(input_ids=ids, do_sample=False, max_new_tokens=24)[0, ids.shape[1] :])


def test_tau_one_equals_generate_with_history_processors_and_eos():
    """Repetition penalty reads the token history; several EOS ids end rows at different steps."""
    tok = make_tokenizer()
    base = make_model("llama")
    mars = hf_mars.to_mars(make_model("llama"), tok, block_size=8)
    enc = encode(tok)
    free = base.generate(**enc, do_sample=False, max_new_tokens=30)[:, enc.input_ids.shape[1] :]
    eos = [int(free[0, 5]), int(free[2, 9])]
    kwargs = dict(do_sample=False, max_new_tokens=30, repetition_penalty=1.3, eos_token_id=eos)
    ref = base.generate(**enc, **kwargs)
    assert torch.equal(mars.generate(**enc, mars_tau=1.0, **kwargs), ref)


def test_tau_one_sampling_equals_generate_sampling():
    tok = make_tokenizer()
    base = make_model("qwen2")
    mars = hf_mars.to_mars(make_model("qwen2"), tok, block_size=4)
    enc = encode(tok, ["the quick brown fox"])
    kwargs = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, max_new_tokens=20)
    torch.manual_seed(123)
    ref = base.generate(**enc, **kwargs)
    torch.manual_seed(123)
    assert torch.equal(mars.generate(**enc, mars_tau=1.0, **kwargs), ref)


def test_without_tau_generate_is_the_base_models():
    tok = make_tokenizer()
    base = make_model("qwen2")
    mars = hf_mars.to_mars(make_model("qwen2"), tok, block_size=4)
    enc = encode(tok)
    for kwargs in (dict(do_sample=False), dict(num_beams=3, do_sample=False)):
        assert torch.equal(
            mars.generate(**enc, max_new_tokens=12, **kwargs), base.generate(**enc, max_new_tokens=12, **kwargs)
        )
    torch.manual_seed(0)
    ref = base.generate(**enc, do_sample=True, max_new_tokens=12)
    torch.manual_seed(0)
    assert torch.equal(mars.generate(**enc, do_sample=True, max_new_tokens=12), ref)


# --- every τ: batched = unbatched = naive ------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_equals_unbatched_and_naive_for_every_tau(family):
    model, tok = sharp_mars_model(family)
    enc = encode(tok)
    mask_id = model.config.mars_mask_token_id
    multi = single = 0
    for tau in (1.0, 0.9, 0.7, 0.5, 0.0):
        out = model.generate(**enc, mars_tau=tau, max_new_tokens=32, return_dict_in_generate=True)
        accepted = torch.cat(out.mars_stats.accepted_per_step)
        multi, single = multi + int((accepted > 1).sum()), single + int((accepted == 1).sum())
        alone = rows_alone(model, tok, enc, mars_tau=tau, max_new_tokens=32)
        for i, row in enumerate(alone):
            batched = strip_pad(out.sequences[i, enc.input_ids.shape[1] :].tolist(), tok.pad_token_id)
            assert batched == row.tolist(), f"tau={tau} row {i}"
            ids = enc.input_ids[i, enc.attention_mask[i].bool()].tolist()
            assert row.tolist() == naive_mars_decode(model, ids, tau, 4, mask_id, 32, tok.eos_token_id)
    assert multi > 20 and single > 20, "the test must exercise both multi-token and single-token passes"


@pytest.mark.parametrize("family", FAMILIES)
def test_mask_cost_batched_equals_unbatched_and_naive(family):
    """Each row's masks come from its own history, so batching cannot change its tokens."""
    model, tok = sharp_mars_model(family)
    enc = encode(tok)
    mask_id = model.config.mars_mask_token_id
    fed = set()
    # [0.7, 0.96, 0.53]: a pass with 3 masks cheaper than with 1 or 2 (as on this CPU): the batch feeds 3, rows
    # ignore them
    for tau, cost in ((1.0, 0.2), (0.7, 0.2), (0.5, 0.1), (0.5, 0.4), (0.0, 0.3), (0.6, [0.7, 0.96, 0.53])):
        kwargs = dict(mars_tau=tau, mars_mask_cost=cost, max_new_tokens=40)
        out = model.generate(**enc, return_dict_in_generate=True, **kwargs)
        fed |= set(out.mars_stats.masks_per_step)
        for i, row in enumerate(rows_alone(model, tok, enc, **kwargs)):
            batched = out.sequences[i, enc.input_ids.shape[1] :].tolist()  # right-padded where the row ended early
            assert batched[: len(row)] == row.tolist() and set(batched[len(row) :]) <= {tok.pad_token_id}
            ids = enc.input_ids[i, enc.attention_mask[i].bool()].tolist()
            naive = naive_mars_decode(model, ids, tau, 4, mask_id, 40, tok.eos_token_id, mask_cost=cost)
            assert row.tolist() == naive, f"tau={tau} cost={cost} row {i}"
    assert fed == {0, 1, 2, 3}, "the test must exercise every mask count, none included"


def test_a_pass_moves_each_mask_rate_by_the_schedule_rule():
    """`schedule.rates_after` reads each mask's move from a table (`schedule.rate_moves`): `naive_mars_decode`'s rule,
    case by case, for every offer, every count of masks paid, on a probing pass and on others."""
    most, step, recover, every = 3, schedule.RATE_STEP, schedule.RECOVER, schedule.PROBE_EVERY
    counts, passes = torch.arange(most + 1), torch.tensor([0, 1, every, 13])
    grid = torch.meshgrid(counts, counts, passes, indexing="ij")
    offered, paid, passes = (t.flatten() for t in grid)
    rate = torch.rand(offered.numel(), most, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    moved = schedule.rates_after(rate, offered, paid, passes, schedule.rate_moves(most))
    for row, (o, p, n) in enumerate(zip(offered.tolist(), paid.tolist(), passes.tolist())):
        for j in range(most):
            want = rate[row, j].item()
            if j < min(o, p + 1):  # seen: toward what happened to it
                want = (1 - step) * want + step * float(j < p)
            elif j >= o and n % every == 0:  # not offered, on a probing pass: back toward "accepted"
                want = want + recover * (1 - want)
            assert moved[row, j].item() == pytest.approx(want, rel=0, abs=1e-12), (o, p, n, j)
    assert (moved != rate).any(dim=1).float().mean() > 0.5, "most cases must move some rate"


def test_mask_cost_drops_masks_that_fail_and_keeps_those_that_pay(trained_toy):
    """On a trained toy, one prompt at a time: where masks are rarely confident (τ = 0.9) most are dropped at no loss
    of
    tokens per forward; where they pay (counting, τ = 0.5) the tokens per forward stay; and by the cost model's own
    measure (tokens per unit of time, a mask costing 0.2 of a pass) the cost-aware decoder beats B-1 masks every pass.
    (In a batch the widest offer is fed to every row; the offers stay per row, so that batching changes no token.)"""
    model, tok = trained_toy
    counting = [[{"role": "user", "content": f"Count from {a} to {a + 30}."}] for a in (3, 40)]
    counting = [
        tok.apply_chat_template(m, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        for m in counting
    ]
    enc = toy_prompts(tok)
    toy = [enc.input_ids[i : i + 1, enc.attention_mask[i].bool()] for i in range(enc.input_ids.shape[0])]
    for prompts, tau in ((toy, 0.9), (counting, 0.5), (toy, 0.5)):
        tokens, passes, masks = {}, {}, {}
        for cost in (0.0, 0.2):
            runs = [
                model.generate(
                    input_ids=ids, mars_tau=tau, mars_mask_cost=cost, max_new_tokens=60, return_dict_in_generate=True
                ).mars_stats
                for ids in prompts
            ]
            tokens[cost] = sum(int(r.new_tokens.sum()) for r in runs)
            passes[cost] = sum(r.forward_passes for r in runs)
            masks[cost] = sum(sum(r.masks_per_step) for r in runs)
        per_forward = {c: tokens[c] / passes[c] for c in tokens}
        speed = {c: tokens[c] / (passes[c] + 0.2 * masks[c]) for c in tokens}
        assert per_forward[0.2] > 0.9 * per_forward[0.0], tau
        assert speed[0.2] > 1.03 * speed[0.0], tau
        if tau == 0.9:
            assert masks[0.2] < 0.4 * masks[0.0]


def test_history_processors_with_rows_leaving_the_batch():
    """Repetition penalty keeps per-row state for the whole batch; rows that finish early leave MARS's batch."""
    model, tok = sharp_mars_model("llama")
    enc = encode(tok)
    free = model.generate(**enc, mars_tau=0.6, max_new_tokens=30, repetition_penalty=1.2)[:, enc.input_ids.shape[1] :]
    kwargs = dict(mars_tau=0.6, max_new_tokens=30, repetition_penalty=1.2, eos_token_id=int(free[1, 4]))
    out = model.generate(**enc, return_dict_in_generate=True, **kwargs)
    assert len(set(out.mars_stats.passes_per_row.tolist())) > 1  # rows did finish at different passes
    for i, row in enumerate(rows_alone(model, tok, enc, **kwargs)):
        assert strip_pad(out.sequences[i, enc.input_ids.shape[1] :].tolist(), tok.pad_token_id) == row.tolist()


# --- τ is live -------------------------------------------------------------------------------------------------


def test_tau_callable_is_read_before_every_pass():
    model, tok = sharp_mars_model("qwen2", dtype=torch.float32)
    enc = encode(tok, ["hello world"])
    controller = hf_mars.TauController(1.0)
    reads = []

    def tau():
        reads.append(controller.tau)
        if len(reads) == 6:
            controller.tau = 0.0  # e.g. a slider moved while the generation runs
        return controller()

    out = model.generate(**enc, mars_tau=tau, max_new_tokens=40, return_dict_in_generate=True)
    stats = out.mars_stats
    assert stats.tau_per_step[:5] == [1.0] * 5 and set(stats.tau_per_step[5:]) == {0.0}
    assert len(reads) == stats.forward_passes
    assert all(int(a) == 1 for a in stats.accepted_per_step[:5])
    assert all(int(a) == 4 for a in stats.accepted_per_step[5:-1])  # τ = 0 accepts every slot
    assert int(stats.new_tokens[0]) == 40


# --- stopping ----------------------------------------------------------------------------------------------------


def test_max_new_tokens_is_exact():
    model, tok = sharp_mars_model("qwen2")
    enc = encode(tok)
    for n in (1, 7, 13):
        out = model.generate(**enc, mars_tau=0.0, max_new_tokens=n, eos_token_id=None, return_dict_in_generate=True)
        assert out.sequences.shape[1] == enc.input_ids.shape[1] + n
        assert out.mars_stats.new_tokens.tolist() == [n] * 3


def test_eos_inside_an_accepted_chunk_ends_the_row():
    model, tok = sharp_mars_model("qwen2")
    enc = encode(tok)
    free = model.generate(**enc, mars_tau=0.0, max_new_tokens=24, eos_token_id=None)[:, enc.input_ids.shape[1] :]
    eos = int(free[1, 6])  # a token that row 1 produces mid-chunk (τ = 0 accepts 4 per pass)
    out = model.generate(**enc, mars_tau=0.0, max_new_tokens=24, eos_token_id=[eos, 999], return_dict_in_generate=True)
    for i in range(3):
        row = free[i].tolist()
        expect = row[: row.index(eos) + 1] if eos in row else row
        got = out.sequences[i, enc.input_ids.shape[1] :].tolist()
        assert got[: len(expect)] == expect
        assert all(t == tok.pad_token_id for t in got[len(expect) :])
        assert int(out.mars_stats.new_tokens[i]) == len(expect)


def test_stop_strings_and_custom_criteria():
    from transformers.generation.stopping_criteria import StopStringCriteria

    model, tok = sharp_mars_model("qwen2")
    enc = encode(tok, ["the quick brown fox"])
    prompt = enc.input_ids.shape[1]
    free = model.generate(**enc, mars_tau=0.0, max_new_tokens=30, eos_token_id=None)
    letters = [t for t in free[0, prompt + 3 :].tolist() if tok.decode([t]).isascii() and tok.decode([t]).isalnum()]
    stop = tok.decode(letters[0])
    criterion = StopStringCriteria(tok, [stop])
    end = next(n for n in range(prompt + 1, free.shape[1] + 1) if criterion(free[:, :n], None)[0])
    out = model.generate(**enc, mars_tau=0.0, max_new_tokens=30, eos_token_id=None, stop_strings=stop, tokenizer=tok)
    assert torch.equal(out, free[:, :end])  # stopped at the very token that completed the stop string
    base = make_model("qwen2", dtype=torch.float64)
    base.load_state_dict(model.state_dict())
    kwargs = dict(max_new_tokens=30, eos_token_id=None, stop_strings=stop, tokenizer=tok)
    assert torch.equal(model.generate(**enc, mars_tau=1.0, **kwargs), base.generate(**enc, do_sample=False, **kwargs))

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= enc.input_ids.shape[1] + 9)

    out = model.generate(**enc, mars_tau=0.0, max_new_tokens=30, eos_token_id=None, stopping_criteria=[StopAfter()])
    assert out.shape[1] == enc.input_ids.shape[1] + 9


# --- streaming ---------------------------------------------------------------------------------------------------


def test_streamer_gets_one_chunk_per_pass():
    model, tok = sharp_mars_model("llama", dtype=torch.float32)
    enc = encode(tok, ["hello world"])
    streamer = Recorder()
    out = model.generate(**enc, mars_tau=0.6, max_new_tokens=30, streamer=streamer, return_dict_in_generate=True)
    prompt, *chunks = streamer.chunks
    assert prompt == enc.input_ids[0].tolist() and streamer.ended
    assert [len(c) for c in chunks] == [int(a) for a in out.mars_stats.accepted_per_step]
    assert sum(chunks, []) == out.sequences[0, len(prompt) :].tolist()
    assert max(len(c) for c in chunks) > 1


def test_text_iterator_streamer():
    from threading import Thread

    from transformers import TextIteratorStreamer

    model, tok = sharp_mars_model("qwen2", dtype=torch.float32)
    enc = encode(tok, ["hello"])
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    result = {}
    thread = Thread(
        target=lambda: result.update(out=model.generate(**enc, mars_tau=0.5, max_new_tokens=20, streamer=streamer))
    )
    thread.start()
    text = "".join(streamer)
    thread.join()
    assert text == tok.decode(result["out"][0, enc.input_ids.shape[1] :])


# --- sampling ----------------------------------------------------------------------------------------------------


def test_sampling_with_tau_is_seeded_and_batched():
    model, tok = sharp_mars_model("qwen2")
    enc = encode(tok)
    kwargs = dict(
        mars_tau=0.7, do_sample=True, temperature=0.7, top_k=20, max_new_tokens=20, return_dict_in_generate=True
    )
    torch.manual_seed(1)
    a = model.generate(**enc, **kwargs)
    torch.manual_seed(1)
    b = model.generate(**enc, **kwargs)
    assert torch.equal(a.sequences, b.sequences)
    assert a.mars_stats.mean_tokens_per_forward > 1.0
    # top_k = 1 sampling is greedy decoding of the same processed scores
    greedy = model.generate(**enc, mars_tau=1.0, max_new_tokens=20)
    assert torch.equal(model.generate(**enc, mars_tau=1.0, do_sample=True, top_k=1, max_new_tokens=20), greedy)


@pytest.mark.parametrize("measure", ["entropy", "margin"])
def test_other_confidence_measures(measure):
    model, tok = sharp_mars_model("qwen2")
    enc = encode(tok)
    out = model.generate(**enc, mars_tau=0.3, mars_confidence=measure, max_new_tokens=24, return_dict_in_generate=True)
    for i, row in enumerate(rows_alone(model, tok, enc, mars_tau=0.3, mars_confidence=measure, max_new_tokens=24)):
        assert strip_pad(out.sequences[i, enc.input_ids.shape[1] :].tolist(), tok.pad_token_id) == row.tolist()
    probs = torch.tensor([[0.7, 0.2, 0.1]])
    value = confidence(probs, torch.tensor([0]), measure)
    expected = (
        0.5 if measure == "margin" else 1 - float(torch.special.entr(probs).sum() / torch.log(torch.tensor(3.0)))
    )
    assert value.item() == pytest.approx(expected)


# --- refusals ----------------------------------------------------------------------------------------------------


def test_clear_errors():
    model, tok = sharp_mars_model("qwen2", dtype=torch.float32)
    enc = encode(tok)
    one = encode(tok, ["a"])
    bad = [
        (dict(mars_tau=1.5), "mars_tau"),
        (dict(mars_tau=-0.1), "mars_tau"),
        (dict(mars_tau="0.9"), "mars_tau"),
        (dict(mars_tau=0.9, mars_block_size=0), "mars_block_size"),
        (dict(mars_tau=0.9, num_beams=2), "greedy"),
        (dict(mars_tau=0.9, prompt_lookup_num_tokens=3), "assisted"),
        (dict(mars_tau=0.9, output_scores=True, return_dict_in_generate=True), "`output_scores` .* `mars_tau`"),
        (dict(mars_verify=True, output_logits=True, return_dict_in_generate=True), "`output_logits` .* `mars_verify`"),
        (dict(mars_verify=True, num_beams=2), "`mars_verify` works with greedy"),
        (dict(mars_tau=0.9, mars_confidence="vibes"), "mars_confidence"),
        (dict(mars_tau=0.9, mars_mask_cost=-0.1), "mars_mask_cost"),
        (dict(mars_tau=0.9, mars_mask_cost="cheap"), "mars_mask_cost"),
        (dict(mars_tau=0.9, mars_mask_cost=[0.1, 0.2]), "one cost per mask count"),
        (dict(mars_tau=0.9, stop_strings="x"), "tokenizer"),
        (dict(mars_tau=0.9, mars_verify=True, mars_draft_candidates=0), "mars_draft_candidates"),
        (dict(mars_tau=0.9, mars_verify=True, mars_lookup=-1), "mars_lookup"),
        (dict(mars_tau=0.9, mars_lookup=3), "mars_verify=True"),
    ]
    for kwargs, words in bad:
        with pytest.raises(ValueError, match=words):
            model.generate(**enc, max_new_tokens=4, **kwargs)
    with pytest.raises(ValueError, match="assisted"):
        model.generate(**one, max_new_tokens=4, mars_tau=0.9, assistant_model=make_model("qwen2"))
    with pytest.raises(ValueError, match="batch size must be 1"):
        model.generate(**enc, max_new_tokens=4, mars_tau=0.9, streamer=Recorder())
    with pytest.raises(ValueError, match="mars_tau"):
        model.generate(**one, max_new_tokens=4, mars_tau=lambda: 2.0)
    with pytest.raises(ValueError, match="mars_tau"):
        hf_mars.TauController(1.1)

    plain = make_model("qwen2")
    plain.__class__ = hf_mars.mars_class(type(plain))  # a MARS class without a mask token
    with pytest.raises(ValueError, match="to_mars"):
        plain.generate(**one, max_new_tokens=4, mars_tau=0.9)
    with pytest.raises(ValueError, match="block_size"):
        hf_mars.to_mars(make_model("qwen2"), tok, block_size=0)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("family", sorted(SLIDING))
def test_sliding_window_models_are_exact_past_the_window(family, attention):
    """Holes push cache slots apart, so MARS counts a sliding window in positions: every mode equals greedy
    `generate()` long past the window, on hybrid (Gemma 3, Qwen2) and all-sliding (Mistral) models, and τ-mode equals
    the naive decoder, whose passes hold no cache and so no holes. In the runner's graph pass, which builds the
    windows itself."""
    model, tok = sliding_mars_model(family, attention)
    enc = encode(tok)
    reference = GenerationMixin.generate(model, **enc, do_sample=False, max_new_tokens=24)
    unwindowed, _ = sliding_mars_model(family, attention, window=None)  # the same weights: the window matters
    assert not torch.equal(GenerationMixin.generate(unwindowed, **enc, do_sample=False, max_new_tokens=24), reference)
    for mode in (
        dict(mars_tau=1.0),
        dict(mars_verify=True),
        dict(mars_verify=True, mars_draft_candidates=3, mars_lookup=3),
        dict(mars_verify=True, cache_implementation="static"),
        dict(mars_verify=True, mars_draft_candidates=3, mars_lookup=3, cache_implementation="static"),
        dict(mars_tau=1.0, cache_implementation="static"),
    ):
        model.__dict__.pop("_mars_graphs", None)
        assert torch.equal(model.generate(**enc, max_new_tokens=24, **mode), reference), mode
        assert model.__dict__.get("_mars_graphs"), mode  # the graph pass
    mask_id = model.config.mars_mask_token_id
    for extra in ({}, dict(cache_implementation="static")):
        model.__dict__.pop("_mars_graphs", None)
        out = model.generate(**enc, mars_tau=0.6, max_new_tokens=24, return_dict_in_generate=True, **extra)
        assert model.__dict__.get("_mars_graphs")
        assert max(int(a.max()) for a in out.mars_stats.accepted_per_step) > 1  # multi-token passes: holes
        for i in range(len(PROMPTS)):
            ids = enc.input_ids[i, enc.attention_mask[i].bool()].tolist()
            batched = out.sequences[i, enc.input_ids.shape[1] :].tolist()
            assert batched == naive_mars_decode(model, ids, 0.6, 4, mask_id, 24, None), (extra, i)


def test_what_no_runner_can_decode_is_refused_by_name_before_any_forward():
    """A runner's pass builds 4D masks and keeps its cache and books on one device: an attention implementation that
    takes no 4D mask (flash attention), and a model spread over several devices, are refused by name in every mode,
    before any forward; plain `generate()` (no MARS setting) still runs."""
    model, tok = sharp_mars_model("llama")
    enc = encode(tok)
    forwards = []
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    modes = (
        dict(mars_tau=0.9),
        dict(mars_tau=1.0),
        dict(mars_verify=True),
        dict(mars_tau=0.9, cache_implementation="static"),
    )
    try:
        model.config._attn_implementation = "flash_attention_2"
        for mode in modes:
            with pytest.raises(ValueError, match="4D attention masks, which 'flash_attention_2' does not take"):
                model.generate(**enc, max_new_tokens=4, **mode)
        with pytest.raises(ValueError, match="4D attention masks"):
            model.mars_session(enc.input_ids, attention_mask=enc.attention_mask, mars_tau=0.9, max_new_tokens=4)
        model.config._attn_implementation = "sdpa"
        model.hf_device_map = {"model.embed_tokens": "cpu", "model.layers": 0, "lm_head": "cpu"}
        for mode in modes:
            with pytest.raises(ValueError, match=r"spans \['0', 'cpu'\] \(`device_map`\): load it on one"):
                model.generate(**enc, max_new_tokens=4, **mode)
        assert not forwards
    finally:
        hook.remove()
        del model.hf_device_map
    assert model.generate(**enc, max_new_tokens=4).shape[1] == enc.input_ids.shape[1] + 4
