"""Shape fuzz of the static-cache pass (the graph pass): batch sizes 1 to 8, ragged left-padded prompts, every draft
tree, τ-mode and lossless, greedy and seeded sampling, a repetition penalty, minimum lengths, a mask schedule, caches
of exactly the slots a run needs, and two threads on one model. Greedy lossless and τ = 1 give plain greedy
`generate()`'s tokens (float32: exact), seeded sampling at τ = 1 plain sampling's; every greedy mode gives a row
batched what it gives alone; a seed draws the same tokens again."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from helpers import toy_prompts
from tokenizers import Tokenizer, models, pre_tokenizers
from torch._dynamo.utils import counters
from transformers import CompileConfig, GenerationMixin, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import hf_mars
from hf_mars.decoding import scoring

PAD, EOS = 500, 501
MODES = {
    "tau=0.9": dict(mars_tau=0.9),
    "tau=1": dict(mars_tau=1.0),
    "lossless chain": dict(mars_verify=True),
    "lossless runner-ups": dict(mars_verify=True, mars_draft_candidates=3),
    "lossless per-depth": dict(mars_verify=True, mars_draft_candidates=[2, 3, 2]),
    "lossless lookup": dict(mars_verify=True, mars_block_size=2, mars_lookup=4),
    "lossless tree and lookup": dict(mars_verify=True, mars_draft_candidates=2, mars_lookup=3),
    "typical tree": dict(mars_verify=True, mars_accept="typical", mars_draft_candidates=2, mars_lookup=3),
}
SCHEDULED = {  # a mask cost: each row uses the masks its own schedule offers
    "tau=0.9 mask cost": dict(mars_tau=0.9, mars_mask_cost=0.3),
    "lossless mask cost": dict(mars_verify=True, mars_draft_candidates=2, mars_lookup=3, mars_mask_cost=[0.1, 0.5, 2]),
}
EXACT = ("tau=1", "lossless chain", "lossless runner-ups", "lossless per-depth", "lossless lookup",
         "lossless tree and lookup", "lossless mask cost")  # fmt: skip
# The rows of the batch-4 case that once overflowed the static cache (rows done early kept filling slots)
RAGGED = ["w5 w17 w200 w33 w8 w9", "w9 w9 w1 w300 w301 w302 w77 w12", "w450 w3", "w7 w70 w170 w270"]


@pytest.fixture(scope="module")
def thin():
    """A thin, deep random Llama (30 layers of width 64) whose peaked `lm_head` spreads confidences over (0, 1), and
    a word-level tokenizer: rows end at EOS at different passes."""
    vocab = {f"w{i}": i for i in range(500)} | {"<pad>": PAD, "<eos>": EOS}
    words = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", padding_side="left")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=30, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=PAD,
        eos_token_id=EOS, bos_token_id=None,
    )  # fmt: skip
    base = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        base.lm_head.weight.mul_(25.0)
    return hf_mars.to_mars(base, tok, block_size=4), tok


def prompts(batch: int, seed: int) -> list[str]:
    """`batch` prompts of 1 to 9 words (the batch-4 case's rows first)."""
    rng = random.Random(seed)
    extra = [" ".join(f"w{rng.randrange(500)}" for _ in range(rng.randint(1, 9))) for _ in range(batch)]
    return (RAGGED + extra)[:batch] if seed == 0 else extra


def branched(model) -> bool:
    """Whether a graph pass built on `model` fed a draft tree with branches (more drafts than depths)."""
    return any(len(shape.tree) > shape.tree.depth for shape, *_ in model.__dict__.get("_mars_graphs", {}))


SAMPLING = dict(do_sample=True, temperature=0.7, top_k=50, top_p=1.0)


def decode(model, enc, mode: str, *, edge=True, sample_seed=None, max_new_tokens=48, **processing):
    """`generate()` on a static cache of exactly the slots the run needs (`edge`), through the graph pass; seeded
    sampling (T = 0.7, top-k 50) where `sample_seed` is given; `processing`: more of `generate()`'s keywords (a
    repetition penalty)."""
    settings = dict(MODES[mode])
    sampling = dict(do_sample=False, **processing)
    if sample_seed is not None:
        sampling = dict(**SAMPLING, **processing)
        torch.manual_seed(sample_seed)
    batch, length = enc["input_ids"].shape
    size = model.mars_cache_length(length, max_new_tokens, batch, **settings) if edge else None
    model.__dict__.pop("_previous_max_cache_length", None)  # else generate() keeps the largest cache it made
    return model.generate(
        **enc, max_new_tokens=max_new_tokens, cache_implementation="static", pad_token_id=PAD,
        **({"max_cache_len": size} if size else {}), **sampling, **settings,
    )  # fmt: skip


def check_seeded(model, enc, mode: str, **processing) -> None:
    """Seeded sampling in the graph pass: the same seed draws the same tokens again, another seed others, and at τ = 1
    (no token drawn for a mask) plain sampling's tokens for that seed."""
    sampled = decode(model, enc, mode, sample_seed=3, **processing)
    assert torch.equal(sampled, decode(model, enc, mode, sample_seed=3, **processing))
    assert not torch.equal(sampled, decode(model, enc, mode, sample_seed=4, **processing)), "another seed"
    if mode == "tau=1":
        torch.manual_seed(3)
        plain = GenerationMixin.generate(model, **enc, max_new_tokens=48, pad_token_id=PAD, **SAMPLING, **processing)
        assert new_tokens(sampled, enc) == new_tokens(plain, enc)


def new_tokens(out, enc) -> list[list[int]]:
    """Each row's new tokens, up to and with its EOS (padding after it dropped)."""
    rows = []
    for row in out[:, enc["input_ids"].shape[1] :].tolist():
        rows.append(row[: row.index(EOS) + 1] if EOS in row else [t for t in row if t != PAD])
    return rows


CASES = [(batch, mode) for batch in range(1, 9) for mode in MODES]
FUZZ = random.Random(7).sample(CASES, 14) + [(4, "lossless chain"), (4, "lossless tree and lookup"), (8, "tau=0.9")]
FUZZ += [(3, "tau=0.9 mask cost"), (4, "lossless mask cost"), (7, "lossless mask cost")]
MODES |= SCHEDULED


@pytest.mark.parametrize("batch, mode", sorted(set(FUZZ)), ids=lambda v: str(v).replace(" ", "-"))
def test_ragged_batches_on_a_cache_at_the_edge(thin, batch, mode):
    model, tok = thin
    seed = 0 if batch <= len(RAGGED) else batch
    enc = tok(prompts(batch, seed), return_tensors="pt", padding=True)
    model.__dict__.pop("_mars_graphs", None)
    graphed = decode(model, enc, mode)
    assert model.__dict__.get("_mars_graphs"), "the run must continue as graph passes"
    if mode in EXACT:
        greedy = GenerationMixin.generate(model, **enc, max_new_tokens=48, do_sample=False, pad_token_id=PAD)
        assert new_tokens(graphed, enc) == new_tokens(greedy, enc)
    rows = new_tokens(graphed, enc)
    for row in range(batch):
        alone = {k: v[row : row + 1, enc["attention_mask"][row].bool()] for k, v in enc.items()}
        assert new_tokens(decode(model, alone, mode), alone)[0] == rows[row], f"row {row} alone"


@pytest.mark.parametrize("mode", ["tau=0.9", "tau=1", "lossless chain", "lossless tree and lookup", "typical tree"])
def test_seeded_sampling_in_the_graph_pass_repeats_and_is_plain_samplings_at_tau_1(thin, mode):
    """A seed draws the same tokens again in the graph pass, and at τ = 1 plain sampling's. (Speculative sampling
    keeps its drafts a chain; typical acceptance verifies the greedy tree of warped scores.)"""
    model, tok = thin
    enc = tok(prompts(5, 3), return_tensors="pt", padding=True)
    model.__dict__.pop("_mars_graphs", None)
    decode(model, enc, mode, sample_seed=1)
    assert model.__dict__.get("_mars_graphs"), "sampling must continue as graph passes"
    check_seeded(model, enc, mode)


@pytest.mark.parametrize("mode", ["tau=1", "tau=0.9", "lossless chain", "lossless tree and lookup"])
def test_a_repetition_penalty_runs_in_the_graph_pass_as_generate_applies_it(thin, mode):
    """A repetition penalty scores each slot on its own history (the text and the slots before it, or a tree node's
    path), at fixed shape: τ = 1 and lossless mode give `generate()`'s with the same penalty, its drafts a tree where
    asked; sampled with it, seeds as `check_seeded` holds them."""
    model, tok = thin
    enc = tok(prompts(5, 11), return_tensors="pt", padding=True)
    model.__dict__.pop("_mars_graphs", None)
    graphed = decode(model, enc, mode, repetition_penalty=1.3)
    assert model.__dict__.get("_mars_graphs"), "a penalised run must continue as graph passes"
    assert branched(model) == ("tree" in mode), "a penalty keeps the tree it is given"
    if mode in EXACT:
        plain = dict(max_new_tokens=48, do_sample=False, pad_token_id=PAD, repetition_penalty=1.3)
        penalised = GenerationMixin.generate(model, **enc, **plain)
        assert new_tokens(graphed, enc) == new_tokens(penalised, enc)
        unpenalised = GenerationMixin.generate(model, **enc, **{**plain, "repetition_penalty": 1.0})
        assert new_tokens(penalised, enc) != new_tokens(unpenalised, enc), "the penalty must change the text"
    check_seeded(model, enc, mode, repetition_penalty=1.3)


# generate() options whose processors read the scores alone, given the token they bar or bias
SCORES_ONLY = {
    "renormalize_logits, remove_invalid_values": lambda _: dict(renormalize_logits=True, remove_invalid_values=True),
    "suppress_tokens": lambda token: dict(suppress_tokens=[token]),
    "bad_words_ids": lambda token: dict(bad_words_ids=[[token]]),
    "sequence_bias": lambda token: dict(sequence_bias=[[[token], -3.0]]),
}


@pytest.mark.parametrize("option", SCORES_ONLY)
@pytest.mark.parametrize("mode", ["tau=1", "tau=0.9", "lossless tree and lookup"])
def test_processors_that_read_only_the_scores_run_in_the_graph_pass(thin, mode, option):
    """Processors that read no text (`scoring.reads_scores_only`: barring, biasing single tokens, renormalising)
    score every slot in one call in the graph pass: τ = 1 and lossless mode `generate()`'s with the same option (and
    seeded sampling as `check_seeded` holds it), a draft tree kept where asked. The barred or biased token is
    the one plain greedy decoding emits most here, so that the option changes the text on any CPU."""
    model, tok = thin
    enc = tok(prompts(5, 11), return_tensors="pt", padding=True)
    plain = dict(max_new_tokens=48, do_sample=False, pad_token_id=PAD)
    unprocessed = GenerationMixin.generate(model, **enc, **plain)
    emitted = [t for row in new_tokens(unprocessed, enc) for t in row if t != EOS]
    processing = SCORES_ONLY[option](max(set(emitted), key=emitted.count))
    model.__dict__.pop("_mars_graphs", None)
    graphed = decode(model, enc, mode, **processing)
    assert model.__dict__.get("_mars_graphs"), "the run must continue as graph passes"
    assert branched(model) == ("tree" in mode), "the option keeps the tree it is given"
    if mode in EXACT:
        processed = GenerationMixin.generate(model, **enc, **plain, **processing)
        assert new_tokens(graphed, enc) == new_tokens(processed, enc)
        if option != "renormalize_logits, remove_invalid_values":  # these two keep greedy text as it is
            assert new_tokens(processed, enc) != new_tokens(unprocessed, enc), "the option must change the text"
    check_seeded(model, enc, mode, **processing)


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("mode", ["tau=1", "tau=0.9", "lossless tree and lookup"])
def test_ngram_bans_run_in_the_graph_pass(thin, mode, size):
    """`no_repeat_ngram_size` (`scoring.NGRAM_BANS`, by MARS's rule: each row at its own length, one slot at a time)
    runs in the graph pass, drafts a chain (a ban reads the text's order: a branch's would be its own): τ = 1 and
    lossless mode `generate()`'s tokens with the ban, which changes the text; seeded sampling as `check_seeded`."""
    model, tok = thin
    enc = tok(prompts(5, 11), return_tensors="pt", padding=True)
    model.__dict__.pop("_mars_graphs", None)
    graphed = decode(model, enc, mode, no_repeat_ngram_size=size)
    assert model.__dict__.get("_mars_graphs"), "the run must continue as graph passes"
    assert not branched(model), "an n-gram ban keeps drafts a chain"
    if mode in EXACT:
        plain = dict(max_new_tokens=48, do_sample=False, pad_token_id=PAD)
        banned = GenerationMixin.generate(model, **enc, **plain, no_repeat_ngram_size=size)
        assert new_tokens(graphed, enc) == new_tokens(banned, enc)
        unbanned = GenerationMixin.generate(model, **enc, **plain)
        assert new_tokens(banned, enc) != new_tokens(unbanned, enc), "the ban must change the text"
    check_seeded(model, enc, mode, no_repeat_ngram_size=size)


@pytest.mark.parametrize("mode", ["tau=1", "tau=0.9", "lossless tree and lookup"])
def test_min_new_tokens_and_min_length_run_in_the_graph_pass_as_generate_applies_them(trained_toy, mode):
    """EOS barred while a row is short, each row by its own length (the trained toy's rows end at EOS at different
    passes): τ = 1 and lossless mode give `generate()`'s tokens."""
    model, tok = trained_toy
    enc = toy_prompts(tok, n=5, seed=7)
    width = enc["input_ids"].shape[1]
    toy = dict(max_new_tokens=40, cache_implementation="static", do_sample=False, **MODES[mode])
    ends = (model.generate(**enc, **toy)[:, width:] == tok.eos_token_id).long().argmax(dim=1) + 1
    minimum_new = int(ends.min()) + 4
    assert int(ends.min()) < minimum_new <= 40, "some row must end before the minimum without it"
    for minimum in (dict(min_new_tokens=minimum_new), dict(min_length=width + minimum_new)):
        model.__dict__.pop("_mars_graphs", None)
        graphed = model.generate(**enc, **toy, **minimum)
        assert model.__dict__.get("_mars_graphs"), "the run must continue as graph passes"
        assert branched(model) == ("tree" in mode), "a minimum length keeps the tree it is given"
        assert not (graphed[:, width : width + minimum_new - 1] == tok.eos_token_id).any(), minimum
        if mode in EXACT:
            plain = GenerationMixin.generate(model, **enc, max_new_tokens=40, do_sample=False, **minimum)
            assert torch.equal(graphed, plain)


@pytest.mark.parametrize(
    "mode, processing",
    [
        ("tau=0.9", dict(do_sample=True, temperature=0.7, top_k=50)),
        ("lossless chain", dict(repetition_penalty=1.3)),
        ("lossless chain", dict(no_repeat_ngram_size=2)),
        ("tau=0.9", dict(no_repeat_ngram_size=2)),  # slot by slot, each token written into the ban's text
        ("tau=0.9", dict(do_sample=True, temperature=0.7, repetition_penalty=1.3)),  # slot by slot, noise at once
        ("tau=0.9", dict(mars_mask_cost=0.3)),
        ("lossless chain", dict(mars_mask_cost=[0.1, 0.5, 2.0])),
    ],
)
def test_sampled_and_penalised_graph_passes_run_compiled_as_they_run_eagerly(thin, mode, processing):
    """Under `generate()`'s compile path the whole pass, processors, sampling and a mask schedule included, is one
    compiled function (the eager backend here: it guards and traces as inductor does): the same draws, the same
    tokens."""
    model, tok = thin
    enc = tok(prompts(3, 4), return_tensors="pt", padding=True)
    config = CompileConfig(backend="eager", mode=None)
    config._compile_all_devices = True  # generate() compiles on GPUs only unless told
    torch._dynamo.reset()
    common = dict(max_new_tokens=24, cache_implementation="static", pad_token_id=PAD, **MODES[mode], **processing)
    counters.clear()
    torch.manual_seed(1)
    compiled = model.generate(**enc, compile_config=config, **common)
    assert counters["stats"]["unique_graphs"] >= 1, "the passes must run compiled"
    assert not counters["graph_break"], "a pass must read nothing back from the device (CUDA graphs capture it whole)"
    torch.manual_seed(1)
    assert torch.equal(compiled, model.generate(**enc, **common))


@pytest.mark.parametrize("mode", ["tau=1", "lossless chain", "lossless tree and lookup"])
def test_a_compiled_call_with_transformers_own_processors_decodes_eagerly_in_the_runner(thin, mode):
    """A compiled pass cannot call the processors only transformers applies (a ban of several tokens) between its
    slots: under `generate()`'s compile path such a call runs its runner eagerly (nothing compiles; the loop ran it
    once), every pass after the prompt's a graph pass that calls them, with plain `generate()`'s tokens under the
    same ban, which changes the text."""
    model, tok = thin
    enc = tok(prompts(3, 4), return_tensors="pt", padding=True)
    plain = dict(max_new_tokens=24, do_sample=False, pad_token_id=PAD)
    unbanned = new_tokens(GenerationMixin.generate(model, **enc, **plain), enc)
    ban = dict(bad_words_ids=[max(unbanned, key=len)[:2]])  # the longest row's first two tokens: no EOS among them
    config = CompileConfig(backend="eager", mode=None)
    config._compile_all_devices = True  # generate() compiles on GPUs only unless told
    torch._dynamo.reset()
    counters.clear()
    model.__dict__.pop("_mars_graphs", None)
    out = model.generate(**enc, compile_config=config, cache_implementation="static", **plain, **ban, **MODES[mode])
    assert not counters["stats"]["unique_graphs"], "nothing may compile"
    shapes = list(model.__dict__.get("_mars_graphs", {}))
    assert shapes and all(shape.calls for shape, *_ in shapes), "the graph pass calls the processors"
    banned = new_tokens(GenerationMixin.generate(model, **enc, **plain, **ban), enc)
    assert new_tokens(out, enc) == banned and banned != unbanned


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_draw_is_torch_multinomials_seed_for_seed(dtype):
    """`scoring.draw`, which reads nothing back from the device, draws what `torch.multinomial(probs, 1)` draws
    (`generate()`'s sampler) from the same seed: the premise of every seeded test against `generate()`."""
    logits = torch.randn(6, 5, 3000, generator=torch.Generator().manual_seed(0)) * 4
    logits[:, :, 100:] = -float("inf")  # most of the vocabulary at probability 0, as after top-k
    probs = torch.softmax(logits, dim=-1).to(dtype)
    for seed in range(3):
        torch.manual_seed(seed)
        expected = torch.multinomial(probs.reshape(-1, probs.shape[-1]), num_samples=1).view(probs.shape[:-1])
        torch.manual_seed(seed)
        drawn = scoring.draw(probs)
        assert torch.equal(drawn, expected)
        assert (drawn < 100).all()
    torch.manual_seed(0)
    assert not torch.equal(scoring.draw(probs), drawn), "another seed must draw other tokens"


@pytest.mark.parametrize("mode", ["tau=0.9", "lossless tree and lookup"])
def test_two_threads_decode_on_one_model(thin, mode):
    """Two threads, one model, static caches of one shape (prompts of one length): each gets its own tokens, which a
    graph pass lent to one thread at a time guarantees."""
    model, tok = thin
    encs = [tok([text], return_tensors="pt") for text in ("w5 w17 w200 w33 w8 w9", "w9 w9 w1 w300 w301 w302")]
    wants = [decode(model, enc, mode, edge=False) for enc in encs]
    errors = []

    def work(i):
        for _ in range(3):
            try:
                if not torch.equal(decode(model, encs[i], mode, edge=False), wants[i]):
                    errors.append(f"thread {i}: other tokens")
            except Exception as error:  # noqa: BLE001 - reported below, with the thread
                errors.append(f"thread {i}: {type(error).__name__}: {error}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert model._mars_graphs, "the runs must continue as graph passes"
