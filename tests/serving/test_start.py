"""`hf-mars serve` on a fresh machine: healthy at once, pass costs timed in the background, drafting and exact
meanwhile."""

from __future__ import annotations

import threading

import httpx
import pytest
from helpers import make_model, make_tokenizer, serving

from hf_mars import to_mars
from hf_mars.decoding import costs
from hf_mars.tools.measure import passes

pytest.importorskip("uvicorn")

ACCEPTANCE = {"2x1": 1.6, "4x3+8": 2.6}  # tokens per forward, as `hf-mars tune --save` writes them


def test_a_fresh_machine_answers_at_once_and_drafts_while_pass_costs_are_timed(tmp_path, monkeypatch):
    from hf_mars.serving.server import build_app

    monkeypatch.setenv("HF_MARS_CACHE", str(tmp_path / "cache"))  # an empty cost cache
    gate, measuring = threading.Event(), threading.Event()
    real = passes.measure_pass_costs

    def held(*args, **kwargs):  # the measurement waits until the test has been answered
        measuring.set()
        assert gate.wait(120)
        return real(*args, **kwargs)

    monkeypatch.setattr(passes, "measure_pass_costs", held)
    tok, model = make_tokenizer(), make_model("llama")
    to_mars(model, tok, block_size=4)
    model.generation_config.mars_lossless, model.generation_config.mars_acceptance = "auto", ACCEPTANCE
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    app, engine = build_app(str(tmp_path / "ckpt"), dtype="float32", device="cpu", max_batch_size=2)
    with serving(app) as url:
        assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
        assert measuring.wait(30) and not costs.costs_path().exists()  # still measuring
        body = {"model": str(tmp_path / "ckpt"), "prompt": "count to ten", "max_tokens": 12, "mars_verify": True}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        ids = tok("count to ten", return_tensors="pt")
        plain = model.generate(**ids, do_sample=False, max_new_tokens=12)
        assert reply["choices"][0]["text"] == tok.decode(plain[0, ids.input_ids.shape[1] :], skip_special_tokens=True)
        # Until timed, the tree is the prior's for a CPU in float32 at the sessions' batch size: drafts from the start
        prior = costs.prior_costs(model, 2, [costs.pass_width(*costs.parse_tree(name)) for name in ACCEPTANCE])
        tree = costs.choose_tree(ACCEPTANCE, prior)
        assert tree is not None and model.mars_settings(batch_size=2, mars_verify=True)["mars_block_size"] == tree[0]
        gate.set()
        engine.measuring.join(timeout=300)
        assert not engine.measuring.is_alive() and costs.costs_path().exists()
    monkeypatch.setattr(passes, "measure_pass_costs", None)  # the sessions' batch size is measured: none times again
    chosen = model.mars_settings(batch_size=2, mars_verify=True)  # a session's size (--max-batch-size), read
    assert passes.measure(model, [2], mars_verify=True)[2] == chosen


def test_a_server_started_on_a_busy_machine_times_its_costs_once_it_and_the_machine_are_idle(tmp_path, monkeypatch):
    """The timer declines while other work holds the CPU; the server's timing thread tries again after a pause, at a
    moment the server decodes nothing, and stops once every batch size is timed."""
    from hf_mars.serving.engine import measure_in_background

    monkeypatch.setenv("HF_MARS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(passes, "measure_pass_costs", lambda m, b, widths, **_: {w: 0.01 * w for w in widths})
    busy, idle_asked = [1, 1], []  # busy at the first probes, then idle
    monkeypatch.setattr(passes, "busy_cores", lambda threads=None: busy.pop() if busy else 0)
    tok, model = make_tokenizer(), make_model("llama")
    to_mars(model, tok, block_size=4)
    model.generation_config.mars_lossless, model.generation_config.mars_acceptance = "auto", ACCEPTANCE
    serving_rows = [True, False]  # the server decodes at the first look, then not

    def idle() -> bool:
        idle_asked.append(1)
        return not serving_rows.pop(0) if serving_rows else True

    thread = measure_in_background(model, 2, idle=idle, retry_s=0.05)
    thread.join(timeout=300)
    assert not thread.is_alive() and not busy and len(idle_asked) >= 2
    assert passes.declined() == set()
    for rows in (1, 2):  # every band timed, none marked busy
        costs.pass_costs(model, rows, [1, 4])
