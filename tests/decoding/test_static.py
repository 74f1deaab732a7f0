"""A static cache (`cache_implementation="static"`) and `torch.compile`: the dynamic cache's tokens, fixed shapes."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch._dynamo
from helpers import StopRowAfterCalls, make_model, make_tokenizer, toy_prompts
from torch._dynamo.utils import counters
from transformers import CompileConfig, GenerationMixin, StaticCache
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

import hf_mars
from hf_mars.decoding import graph_state
from hf_mars.decoding.compat import CACHE_ARG

MODES = {
    "tau=1": dict(mars_tau=1.0),
    "tau=0.9": dict(mars_tau=0.9),
    "tau=0.7": dict(mars_tau=0.7),
    "tau=0": dict(mars_tau=0.0),
    "tau=0.5 mask cost": dict(mars_tau=0.5, mars_mask_cost=0.2),
    "lossless chain": dict(mars_verify=True),
    "lossless tree": dict(mars_verify=True, mars_block_size=2, mars_draft_candidates=3, mars_lookup=4),
    "lossless per-depth tree": dict(mars_verify=True, mars_draft_candidates=[2, 3, 2], mars_lookup=2),
}


def run(model, enc, static: bool, **kwargs):
    extra = dict(cache_implementation="static") if static else {}
    return model.generate(**enc, max_new_tokens=40, return_dict_in_generate=True, **extra, **kwargs)


@pytest.mark.parametrize("mode", MODES)
def test_static_cache_gives_the_dynamic_caches_tokens_and_passes(trained_toy, mode):
    model, tok = trained_toy
    enc = toy_prompts(tok, n=6, seed=7)  # left-padded: rows of different lengths, some end at EOS before others
    dynamic, static = run(model, enc, False, **MODES[mode]), run(model, enc, True, **MODES[mode])
    assert torch.equal(static.sequences, dynamic.sequences)
    assert torch.equal(static.mars_stats.passes_per_row, dynamic.mars_stats.passes_per_row)
    accepted = torch.stack(static.mars_stats.accepted_per_step)
    assert torch.equal(accepted, torch.stack(dynamic.mars_stats.accepted_per_step))
    if mode != "tau=1":
        assert int(accepted.max()) > 1, "the test must exercise passes that take several tokens"
    if mode.startswith("lossless"):
        greedy = GenerationMixin.generate(model, **enc, do_sample=False, max_new_tokens=40)
        assert torch.equal(static.sequences, greedy)


def test_static_cache_with_lockstep_stopping_criteria_and_sampling(trained_toy):
    """Finished rows stay in a static batch: the criteria still see the whole batch, as with the dynamic cache.
    Sampling: idle rows still draw random numbers, so a seed gives other draws than the dynamic cache's (as rows
    leaving a dynamic batch change the draws of the rest), but the same ones on every run."""
    model, tok = trained_toy
    enc = toy_prompts(tok, n=4, seed=11)
    limits = torch.tensor([5, 9, 13, 17])

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return (input_ids.shape[1] - enc.input_ids.shape[1]) >= limits[: input_ids.shape[0]]

    def generate(static, **kwargs):
        torch.manual_seed(0)
        return run(model, enc, static, mars_tau=0.7, stopping_criteria=StoppingCriteriaList([StopAfter()]), **kwargs)

    dynamic, static = generate(False), generate(True)
    assert torch.equal(static.sequences, dynamic.sequences)
    assert torch.equal(static.mars_stats.new_tokens, limits)
    sampled = generate(True, do_sample=True, temperature=0.8)
    assert torch.equal(sampled.sequences, generate(True, do_sample=True, temperature=0.8).sequences)
    assert torch.equal(sampled.mars_stats.new_tokens, limits)


def test_a_static_cache_that_is_too_small_is_grown_or_refused(trained_toy):
    """generate() sizes a static cache for one token per step; MARS passes write more slots than they keep.
    `mars_cache_length` says how many: a cache of that size is used as it is, one slot less is refused."""
    model, tok = trained_toy
    enc = toy_prompts(tok, n=2, seed=3)
    reference = run(model, enc, False, mars_tau=0.0).sequences
    assert torch.equal(run(model, enc, True, mars_tau=0.0).sequences, reference)
    assert model._previous_max_cache_length > enc.input_ids.shape[1] + 40  # grown by generate()'s own helper
    for mode in (dict(mars_tau=0.0), dict(mars_verify=True, mars_draft_candidates=2, mars_lookup=3)):
        needed = model.mars_cache_length(enc.input_ids.shape[1], 40, **mode)  # what a server sets max_cache_len to
        exact = StaticCache(config=model.config, max_cache_len=needed)
        out = model.generate(**enc, max_new_tokens=40, **{CACHE_ARG: exact}, **mode)
        assert torch.equal(out, model.generate(**enc, max_new_tokens=40, **mode))
        small = StaticCache(config=model.config, max_cache_len=needed - 1)
        with pytest.raises(ValueError, match="StaticCache of at least"):
            model.generate(**enc, max_new_tokens=40, **{CACHE_ARG: small}, **mode)


@pytest.mark.parametrize("static", [True, False], ids=["static cache", "default call"])
def test_compiled_mars_reuses_one_graph_and_equals_the_eager_runner(static):
    """generate()'s compile path (`compile_config`) compiles the passes after the first, on the static cache a
    `cache_implementation="static"` call asks for and on the default call's own (no cache argument: on a GPU the
    default call is the compiled one); every pass has one shape, so after a warm-up generation nothing recompiles
    (dynamo's recompile check would raise). `disable_compile` compiles nothing. The eager backend keeps the test
    fast; it guards and recompiles exactly as inductor does."""
    tok = make_tokenizer()
    model = hf_mars.to_mars(make_model("llama"), tok, block_size=4)
    enc = toy_prompts(tok, n=3, seed=5)
    config = CompileConfig(backend="eager", mode=None)
    config._compile_all_devices = True  # generate() compiles on GPUs only unless told
    torch._dynamo.reset()
    counters.clear()
    for mode in (dict(mars_tau=0.0), dict(mars_verify=True, mars_draft_candidates=2, mars_lookup=2)):
        kwargs = dict(compile_config=config, **mode)
        warm = run(model, enc, static, **kwargs)
        graphs = counters["stats"]["unique_graphs"]
        assert graphs >= 1, "the passes must run compiled"
        with torch._dynamo.config.patch(error_on_recompile=True):
            again = run(model, enc, static, **kwargs)
        assert counters["stats"]["unique_graphs"] == graphs
        assert again.mars_stats.forward_passes > 1
        eager = run(model, enc, static, disable_compile=True, **kwargs)
        assert counters["stats"]["unique_graphs"] == graphs, "disable_compile: nothing compiles"
        assert torch.equal(warm.sequences, eager.sequences)
        assert torch.equal(warm.sequences, run(model, enc, False, **mode).sequences)


class NeverStop(StoppingCriteria):
    """A criterion the host judges after every pass, which stops no row."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@pytest.mark.parametrize("mode", ["tau=0.7", "lossless tree"])
def test_compiled_passes_queued_one_ahead_return_what_passes_read_one_by_one_return(trained_toy, mode, monkeypatch):
    """Captured on CUDA (here compiled), with nothing for the host between passes, `generate()` queues each pass
    before it reads whether the last one finished (`_replay_ahead`): one pass more runs, idle, and is taken back.
    Everything the call returns is what the same compiled passes return read one by one (a stopping criterion the
    host judges after each pass): the tokens, every stat, the cache; the tokens are the eager runner's."""
    model, tok = trained_toy
    enc = toy_prompts(tok, n=4, seed=9)  # rows that stop at EOS at different passes
    config = CompileConfig(backend="eager", mode=None)
    config._compile_all_devices = True  # generate() compiles on GPUs only unless told
    runs, replay = [], graph_state.GraphPass.run
    monkeypatch.setattr(graph_state.GraphPass, "run", lambda g: runs.append(g.eager) or replay(g))
    monkeypatch.setattr("hf_mars.decoding.generate.QUEUE_AHEAD_EVERYWHERE", True)  # as captured passes on CUDA
    judged = run(model, enc, True, **MODES[mode], compile_config=config, stopping_criteria=[NeverStop()])
    after_each = len(runs)
    ahead = run(model, enc, True, **MODES[mode], compile_config=config)
    assert not any(runs), "premise: the passes ran compiled"
    assert after_each == judged.mars_stats.forward_passes - 1, "read one by one: a run a pass after the prompt's"
    assert len(runs) - after_each == ahead.mars_stats.forward_passes, "premise: queued ahead, one pass more ran"
    assert torch.equal(ahead.sequences, judged.sequences)
    for field in ("new_tokens", "passes_per_row"):
        assert torch.equal(getattr(ahead.mars_stats, field), getattr(judged.mars_stats, field)), field
    for field in ("forward_passes", "tau_per_step", "masks_per_step"):
        assert getattr(ahead.mars_stats, field) == getattr(judged.mars_stats, field), field
    assert all(map(torch.equal, ahead.mars_stats.accepted_per_step, judged.mars_stats.accepted_per_step))
    for mine, theirs in zip(ahead.past_key_values.layers, judged.past_key_values.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    eager = run(model, enc, True, **MODES[mode], compile_config=config, disable_compile=True)
    assert torch.equal(ahead.sequences, eager.sequences)


def test_an_eager_tau_pass_on_a_cpu_feeds_no_column_that_is_a_hole_in_every_row(trained_toy):
    """τ-mode right-aligns the tokens each row took last, up to B, in every pass: on a CPU, where a column costs its
    compute, an eager pass skips the columns that are holes in every row still decoding (`GraphPass.narrow`); the
    tokens stay those of the default call."""
    model, tok = trained_toy
    enc = toy_prompts(tok, n=3, seed=2)
    widths = []
    hook = model.register_forward_pre_hook(lambda m, a, k: widths.append(k["input_ids"].shape[1]), with_kwargs=True)
    try:
        out = run(model, enc, True, **MODES["tau=0.7"])
    finally:
        hook.remove()
    whole = 2 * model.config.mars_block_size - 1  # B pending slots, B - 1 masks
    passes = widths[1:]  # after the prompt's
    assert max(passes) <= whole and min(passes) < whole, passes
    assert len(set(passes)) > 1, "the premise: passes after which the rows hold several tokens, and after one"
    assert torch.equal(out.sequences, run(model, enc, False, **MODES["tau=0.7"]).sequences)


@pytest.mark.parametrize("mode", ["lossless tree", "lossless per-depth tree"])  # the toy drafts every chain's node
def test_an_eager_lossless_pass_on_a_cpu_feeds_the_tree_nodes_some_row_drafts(trained_toy, mode, monkeypatch):
    """A lossless pass of a static cache has the full tree's shape, but a row drafts only while its masks are
    confident: on a CPU an eager pass feeds the tree's nodes up to the last one some row drafts, and the masks after
    them (`GraphPass.prune`). The tokens stay greedy
    `generate()`'s, and the passes the whole pass's."""
    model, tok = trained_toy
    enc = toy_prompts(tok, n=1, seed=3)
    widths = []
    hook = model.register_forward_pre_hook(lambda m, a, k: widths.append(k["input_ids"].shape[1]), with_kwargs=True)
    try:
        out = run(model, enc, True, **MODES[mode])
        monkeypatch.setattr(graph_state, "NARROWS", False)
        whole = run(model, enc, True, **MODES[mode])
    finally:
        hook.remove()
    passes = out.mars_stats.forward_passes
    pruned, full = widths[1:passes], widths[passes + 1 :]  # after each run's prompt pass
    assert len(set(full)) == 1 and max(pruned) <= full[0], (pruned, full)
    assert min(pruned) < full[0], "the premise: a pass where no row drafts the whole tree"
    plain = model.generate(**enc, max_new_tokens=40, do_sample=False)
    assert torch.equal(out.sequences, plain) and torch.equal(whole.sequences, plain)
    assert out.mars_stats.forward_passes == whole.mars_stats.forward_passes


@pytest.mark.parametrize("mode", ["tau=0.7", "lossless tree"])
def test_a_static_pass_reads_from_the_device_once(trained_toy, mode, monkeypatch):
    """A device-to-host read stalls the host until the device catches up, which a host-bound GPU step cannot afford:
    with a static cache the host reads once per pass (which rows are still decoding), as generate() does."""
    import traceback

    model, tok = trained_toy
    enc = toy_prompts(tok, n=3, seed=2)
    monkeypatch.setattr(graph_state, "NARROWS", False)  # as on a GPU: a CPU's eager τ-mode pass reads what it may skip
    reads = []
    for name in ("item", "tolist", "__bool__", "__int__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            caller = traceback.extract_stack(limit=2)[0].filename
            if "hf_mars/decoding" in caller.replace("\\", "/"):
                reads.append(caller)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    compactions, compact = [], graph_state.compact_static
    monkeypatch.setattr(graph_state, "compact_static", lambda *a, **k: compactions.append(1) or compact(*a, **k))
    out = run(model, enc, True, **MODES[mode])
    monkeypatch.undo()
    passes = out.mars_stats.forward_passes
    # one per pass, a few to set up and finish, and one per compaction (between passes, once in many)
    assert passes > 5 and len(reads) <= passes + 3 + len(compactions) and len(compactions) < passes / 4


def test_a_static_cache_squeezes_out_its_holes_and_keeps_the_tokens(trained_toy, monkeypatch):
    """A static cache holds the text and a few passes (`mars_cache_length`), not every slot the passes write: the
    drafts a pass rejects leave holes, squeezed out in place when the next pass would not fit. Tokens stay greedy
    `generate()`'s, batched."""
    from hf_mars.decoding import graph_state
    from hf_mars.decoding.settings import resolve_settings

    calls, compact = [], graph_state.compact_static
    monkeypatch.setattr(graph_state, "compact_static", lambda *a, **k: calls.append(1) or compact(*a, **k))
    model, tok = trained_toy
    enc = toy_prompts(tok, n=4, seed=13)
    mode = dict(mars_verify=True, mars_block_size=2, mars_draft_candidates=3, mars_lookup=4)
    size = model.mars_cache_length(enc.input_ids.shape[1], 40, enc.input_ids.shape[0], **mode)
    kv = StaticCache(config=model.config, max_cache_len=size)  # as a server sizes it (generate() may reuse a larger)
    out = model.generate(**enc, max_new_tokens=40, return_dict_in_generate=True, **{CACHE_ARG: kv}, **mode)
    greedy = GenerationMixin.generate(model, **enc, do_sample=False, max_new_tokens=40)
    assert torch.equal(out.sequences, greedy)
    written = out.mars_stats.forward_passes * (1 + resolve_settings(model, None, 4, {}, **mode).drafts_per_pass)
    assert enc.input_ids.shape[1] + written > size, "the passes must write more slots than the cache has"
    assert calls, "the cache must have been compacted"


def _live_tensor_bytes(model) -> int:
    """Bytes of every tensor storage alive in this process (each storage once), the model's own excepted."""
    gc.collect()
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    storages = {}
    with warnings.catch_warnings():  # some objects warn when asked their type (deprecated torch names)
        warnings.simplefilter("ignore")
        # plain tensors only: compiled tests leave fake ones behind, which hold no memory
        tensors = [obj for obj in gc.get_objects() if type(obj) in (torch.Tensor, torch.nn.Parameter)]
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own:
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("cache", [{}, dict(cache_implementation="static")], ids=["no cache", "static"])
@pytest.mark.parametrize("mode", ["tau=0.9", "lossless tree"])
def test_a_run_leaves_no_more_memory_behind_than_plain_generate(mode, cache):
    """The graph pass decodes on the run's own static cache (`generate()`'s, or the default call's own): its K/V are
    held once while it decodes, and after the call no more stays alive than after a plain `generate()` of the same
    cache argument (which keeps nothing) but the pass's small buffers and tables, kept on the model for the next call
    of its shape. The first row stops early (a criterion), so that an eager pass on a CPU feeds the other alone,
    through views of the cache that must not outlive the call."""
    tok = make_tokenizer()
    model = hf_mars.to_mars(make_model("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=4), tok)
    enc = toy_prompts(tok, n=2, seed=7)
    stop = StoppingCriteriaList([StopRowAfterCalls([6, 10**6])])
    kwargs = dict(max_new_tokens=48, stopping_criteria=stop, **cache, **MODES[mode])
    GenerationMixin.generate(model, **enc, do_sample=False, max_new_tokens=48, **cache)
    before = _live_tensor_bytes(model)
    GenerationMixin.generate(model, **enc, do_sample=False, max_new_tokens=48, **cache)
    plain = _live_tensor_bytes(model) - before
    out = model.generate(**enc, return_dict_in_generate=True, **kwargs)
    assert model.__dict__.get("_mars_graphs"), "the run must continue as graph passes"
    slots = next(key[0].slots for key in model._mars_graphs)
    config = model.config
    kv_bytes = 2 * config.num_hidden_layers * 2 * config.num_key_value_heads * slots * config.head_dim * 4
    assert int(out.mars_stats.new_tokens[0]) < int(out.mars_stats.new_tokens[1]), "the premise: a row stopped early"
    del out, stop, kwargs
    left = _live_tensor_bytes(model) - before - plain
    assert left < kv_bytes / 4, f"{left} bytes left behind, the run's K/V were {kv_bytes}"


def test_where_a_pass_is_captured_each_call_of_a_size_reuses_one_static_cache(trained_toy, monkeypatch):
    """On CUDA under the compile path a pass is a captured graph, which writes the addresses it was captured on: there
    a run's cache is kept on the model and lent to the next call of its size (`graph_state.captured`), emptied, so that
    the pass replays its graph rather than capturing anew. Forced on here (no GPU): the second call decodes on the
    first's cache object, held by one call at a time, as does a call that needs fewer slots, and every call gives the
    tokens of a cache of its own."""
    from hf_mars.decoding import generate as mars_generate

    model, tok = trained_toy
    enc = toy_prompts(tok, n=3, seed=7)
    want = run(model, enc, True, **MODES["lossless tree"]).sequences
    monkeypatch.setattr(mars_generate, "captured", lambda device, compiled: True)
    model.__dict__.pop("_mars_caches", None)
    first = run(model, enc, True, **MODES["lossless tree"]).sequences
    (kept,) = [kv for caches in model._mars_caches.values() for kv in caches]
    second = run(model, enc, True, **MODES["lossless tree"]).sequences
    assert [kv for caches in model._mars_caches.values() for kv in caches] == [kept], "the same cache, lent again"
    assert torch.equal(first, want) and torch.equal(second, want)
    shorter = model.generate(**enc, max_new_tokens=20, cache_implementation="static", **MODES["lossless tree"])
    assert [kv for caches in model._mars_caches.values() for kv in caches] == [kept], "a larger cache serves"
    assert torch.equal(shorter, want[:, : shorter.shape[1]])
    other = run(model, toy_prompts(tok, n=2, seed=7), True, **MODES["lossless tree"])  # another size: its own cache
    assert other.sequences.shape[0] == 2 and len(model._mars_caches) == 2
    model.__dict__.pop("_mars_caches", None)


def test_default_calls_of_nearby_lengths_decode_with_one_kept_pass():
    """The default call's own static cache is rounded up (`DEFAULT_SLOTS_STEP`), so that calls whose prompts and
    budgets differ a little share one kept graph pass rather than building one each; each gives greedy `generate()`'s
    tokens."""
    tok = make_tokenizer()
    model = hf_mars.to_mars(make_model("llama"), tok, block_size=4).eval()
    model.__dict__.pop("_mars_graphs", None)
    for n, budget in ((1, 20), (1, 23), (1, 17)):
        enc = toy_prompts(tok, n=n, seed=budget)
        out = model.generate(**enc, max_new_tokens=budget, mars_verify=True)
        assert torch.equal(out, GenerationMixin.generate(model, **enc, do_sample=False, max_new_tokens=budget))
    lengths = {toy_prompts(tok, n=1, seed=seed).input_ids.shape[1] for seed in (20, 23, 17)}
    assert len(lengths) > 1, "the premise: prompts of other lengths"
    assert len(model._mars_graphs) == 1
