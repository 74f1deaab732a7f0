"""The Gradio Space (spaces_demo/app.py), served headless on 127.0.0.1 and driven through `gradio_client`: streaming
pass by pass, τ changed while an answer is written, plain AR side by side, the per-session plot, limits, several
users at once, cancellation, and `python app.py` as a Space runs it (env vars, no hf_mars)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import yaml
from gradio_client import Client
from space_app import SPACE, free_port, load_app, running_app, save_checkpoint


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with running_app(tmp_path_factory.mktemp("space")) as served:
        yield served


def client(url: str) -> Client:
    return Client(url, verbose=False)  # a fresh client is a fresh session: its own τ and runs


def ask(
    c: Client,
    message="hello",
    history=(),
    tau=0.9,
    block_size=4,
    max_new_tokens=40,
    do_sample=False,
    mask_cost=0.0,
    lossless=False,
):
    return c.submit(
        message,
        list(history),
        tau,
        block_size,
        max_new_tokens,
        do_sample,
        0.7,
        0.95,
        mask_cost,
        lossless,
        api_name="/respond",
    )


def answer_text(chat) -> str:
    content = chat[-1]["content"]
    return content if isinstance(content, str) else "".join(part.get("text", "") for part in content)


def rows(plot) -> list:
    """The plot's runs: (run, decoder, tau, tokens_per_forward, tokens_per_second), without the legend's empty rows."""
    return [row for row in plot["data"] if row[0] > 0]


def test_streams_pass_by_pass_and_tau_changes_mid_answer(served):
    app, url, _ = served
    c = client(url)
    job = ask(c, tau=1.0, max_new_tokens=200)
    while len(job.outputs()) < 5 and not job.done():
        time.sleep(0.005)
    c.predict(0.3, api_name="/set_tau")  # its own event, run while the answer streams
    final = job.result()
    updates = job.outputs()

    # Streaming: updates as the passes come (each with every pass since the last, at most 20 a second), growing.
    live = [u[4] for u in updates if u[4] and not u[4]["done"]]
    assert len(live) >= 8
    passes = [s["forward_passes"] for s in live]
    assert passes == sorted(passes) and len(set(passes)) == len(passes)
    lengths = [len(answer_text(u[1])) for u in updates]
    assert lengths == sorted(lengths) and len(set(lengths)) >= 10

    stats = final[4]
    taus, accepted = stats["tau_per_pass"], stats["accepted_per_pass"]
    assert len(taus) == len(accepted) == stats["forward_passes"] and sum(accepted) == stats["new_tokens"] == 200
    switch = taus.index(0.3)
    assert switch >= 5 and set(taus[:switch]) == {1.0} and set(taus[switch:]) == {0.3}
    assert accepted[:switch] == [1] * switch  # τ = 1 is plain AR: one token per pass
    after = accepted[switch:]
    assert max(after) > 1 and sum(after) / len(after) > 1.5 and max(after) <= 4
    assert stats["tokens_per_forward"] == pytest.approx(200 / len(taus))
    # One colored span per pass (text may wait for a character's last byte, so spans <= passes).
    html = final[2]
    assert 1 < html.count('data-n="') <= len(taus) and 'data-n="4"' in html
    assert "forward passes" in final[3] and "tokens/s" in final[3]


def test_plain_ar_side_by_side_equals_tau_1_and_plot_gains_rows(served):
    _, url, _ = served
    c = client(url)
    first = ask(c, "abc", tau=1.0, max_new_tokens=30).result()
    assert first[4]["accepted_per_pass"] == [1] * 30 and len(rows(first[5])) == 1
    ar_text, ar_figures, plot, _ = c.predict(True, api_name="/compare_ar")
    assert ar_text == answer_text(first[1])
    assert "identical to MARS" in ar_figures and "speed-up" in ar_figures
    assert [r[1] for r in rows(plot)] == ["MARS", "AR generate()"]

    low = ask(c, "abc", tau=0.5, max_new_tokens=30).result()
    data = rows(low[5])
    assert len(data) == 3 and data[-1][2] == 0.5 and data[-1][3] > 1.2  # (run, decoder, tau, tokens/forward, tokens/s)
    ar_text, ar_figures, plot, _ = c.predict(True, api_name="/compare_ar")
    assert ar_text == answer_text(first[1]) and len(rows(plot)) == 4
    assert (
        len(rows(client(url).predict("abc", [], 1.0, 4, 5, False, 0.7, 0.95, 0.0, False, api_name="/respond")[5])) == 1
    )  # per session


def test_lossless_checkbox_gives_the_ar_text(served):
    """τ = 0 takes every guess of the masks, a text of its own; ticked, the same τ drafts them, the model verifies
    them, and the answer is plain AR's."""
    _, url, _ = served
    c = client(url)
    fast = ask(c, "abc", tau=0.0, max_new_tokens=24).result()
    ar_text, _, _, _ = c.predict(True, api_name="/compare_ar")
    assert answer_text(fast[1]) != ar_text
    exact = ask(c, "abc", tau=0.0, max_new_tokens=24, lossless=True).result()
    assert exact[4]["lossless"] and exact[4]["done"] and answer_text(exact[1]) == ar_text
    assert (
        exact[4]["block_size"] == 2 and max(exact[4]["masks_per_pass"]) == 1
    )  # the checkpoint's tree, not the slider's 4
    _, ar_figures, _, _ = c.predict(True, api_name="/compare_ar")
    assert "identical to MARS" in ar_figures


def test_limits(served):
    app, url, _ = served
    c = client(url)
    with pytest.raises(Exception, match="at most"):
        ask(c, "x" * (app.MAX_INPUT_TOKENS + 10)).result()
    with pytest.raises(Exception, match="greater than maximum value 4"):
        ask(c, block_size=5).result()  # masks past the trained B = 4 predict nothing
    with pytest.raises(Exception, match="greater than maximum"):
        ask(c, max_new_tokens=app.MAX_NEW_TOKENS + 1).result()
    # A long conversation loses its oldest turns instead.
    turn = "y" * (app.MAX_INPUT_TOKENS // 3)
    history = [
        {"role": role, "content": [{"type": "text", "text": turn}]} for _ in range(4) for role in ("user", "assistant")
    ]
    stats = ask(c, "hello", history=history, max_new_tokens=5).result()[4]
    assert stats["done"] and app.MAX_INPUT_TOKENS // 3 < stats["prompt_tokens"] <= app.MAX_INPUT_TOKENS


def test_two_users_at_once_and_cancel_stops_the_model(served):
    app, url, calls = served
    a, b = client(url), client(url)
    job_a, job_b = ask(a, "one", tau=1.0, max_new_tokens=60), ask(b, "two", tau=0.5, max_new_tokens=60)
    overlapped = False
    while not (job_a.done() and job_b.done()):
        overlapped |= bool(job_a.outputs() and job_b.outputs() and not job_a.done() and not job_b.done())
        time.sleep(0.005)
    assert overlapped  # both streamed at the same time: neither waited for the other
    assert job_a.result()[4]["new_tokens"] == job_b.result()[4]["new_tokens"] == 60

    job = ask(a, tau=1.0, max_new_tokens=app.MAX_NEW_TOKENS)
    while len(job.outputs()) < 5:
        time.sleep(0.005)
    job.cancel()
    time.sleep(0.5)
    before = calls[0]
    time.sleep(0.5)
    assert calls[0] == before  # the generation thread stopped: it holds no CPU that others need


def test_python_app_py_serves_from_env_without_hf_mars(tmp_path):
    """As a Space runs it: `python app.py`, host and port from GRADIO_SERVER_*, model from MARS_MODEL."""
    ckpt, port = save_checkpoint(tmp_path / "ckpt"), free_port()
    env = dict(os.environ, MARS_MODEL=str(ckpt), GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(port))
    app = str(SPACE / "app.py")
    hide = "import sys, runpy; sys.modules['hf_mars'] = None; sys.argv = ['app.py']"
    code = f"{hide}; runpy.run_path({app!r}, run_name='__main__')"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            time.sleep(0.2)
        assert proc.poll() is None, "".join(log)[-3000:]
        out = client(f"http://127.0.0.1:{port}/").predict(
            "hi", [], 0.5, 4, 12, False, 0.7, 0.95, 0.0, False, api_name="/respond"
        )
        assert out[4]["done"] and out[4]["new_tokens"] == 12
        assert "timing pass costs needs hf_mars" in "".join(log)  # said, not failed: it decodes without them
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_without_a_model_says_what_to_do(tmp_path):
    (tmp_path / "app.py").write_text((SPACE / "app.py").read_text())  # away from the repository's outputs/
    (tmp_path / "hf_mars").mkdir()  # and as on a Space: without hf_mars (whose shipped checkpoint it would use)
    (tmp_path / "hf_mars" / "__init__.py").write_text("raise ImportError('not installed')\n")
    env = {k: v for k, v in os.environ.items() if k != "MARS_MODEL"}
    result = subprocess.run(
        [sys.executable, "app.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "MARS_MODEL" in result.stderr and "hf-mars demo" in result.stderr


def test_space_files():
    header = (SPACE / "README.md").read_text().split("---")[1]
    meta = yaml.safe_load(header)
    assert meta["sdk"] == "gradio" and meta["app_file"] == "app.py" and meta["license"] == "apache-2.0"
    assert meta["sdk_version"].split(".")[0] == "6" and len(meta["short_description"]) <= 60 and meta["title"]
    requirements = [
        line.split(">")[0].split("=")[0].strip()
        for line in (SPACE / "requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith(("#", "-"))
    ]
    assert {"torch", "transformers"} <= set(requirements) and not {"hf_mars", "hf-mars"} & set(requirements)
    imports = [line for line in (SPACE / "app.py").read_text().splitlines() if line.startswith(("import ", "from "))]
    assert imports and not any("hf_mars" in line for line in imports)  # the checkpoint brings its decoding code


def test_sampling_and_block_size(served):
    _, url, _ = served
    c = client(url)
    stats = ask(c, tau=0.0, block_size=2, max_new_tokens=20, do_sample=True).result()[4]
    accepted = stats["accepted_per_pass"]  # sampled: an EOS may end it early, in its last pass
    assert stats["done"] and sum(accepted) == stats["new_tokens"] <= 20 and 1 <= accepted[-1] <= 2
    assert accepted[:-1] == [2] * (len(accepted) - 1)  # τ = 0 accepts every slot, and a pass has block_size of them
    ar_text, ar_figures, _, _ = c.predict(True, api_name="/compare_ar")
    assert ar_text and "speed-up" in ar_figures


def test_mask_cost_slider(served):
    """Cost 0 feeds B-1 masks every pass; a cost above any possible return (2 per mask) feeds none after the prompt's
    pass (which writes the runner's static cache, and so feeds all, unused) and uses none: plain AR passes."""
    _, url, _ = served
    free = ask(client(url), tau=0.5, max_new_tokens=16).result()[4]
    assert free["masks_per_pass"] == [3] * free["forward_passes"]
    dear = ask(client(url), tau=0.5, max_new_tokens=16, mask_cost=2.0).result()[4]
    assert dear["mask_cost"] == 2.0 and dear["masks_per_pass"][1:] == [0] * (dear["forward_passes"] - 1)
    assert dear["accepted_per_pass"] == [1] * dear["forward_passes"]


def test_model_dtype_from_the_environment(tmp_path, monkeypatch, capsys):
    """MARS_DTYPE picks the dtype the checkpoint loads in, `auto` (the fastest here, said) when unset; a value that is
    not a dtype stops with the list."""
    app = load_app()
    monkeypatch.setenv("HF_MARS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MARS_MODEL", str(save_checkpoint(tmp_path / "ckpt")))
    monkeypatch.setenv("MARS_DTYPE", "bfloat16")
    model, _ = app.load_model()
    assert model.dtype == torch.bfloat16
    monkeypatch.setenv("MARS_DTYPE", "float32")
    assert app.load_model()[0].dtype == torch.float32
    capsys.readouterr()
    monkeypatch.delenv("MARS_DTYPE")
    chosen = str(app.load_model()[0].dtype).removeprefix("torch.")
    assert f"MARS_DTYPE=auto: dtype {chosen}: expected lossless" in capsys.readouterr().err
    monkeypatch.setenv("MARS_DTYPE", "bf16")
    with pytest.raises(SystemExit, match="MARS_DTYPE must be one of float32, bfloat16, float16"):
        app.load_model()


def test_model_attention_from_the_environment(tmp_path, monkeypatch):
    """MARS_ATTENTION=ordered loads the checkpoint with `ordered` attention (its linear layers follow at the first
    forward), so the Space's lossless answer is plain AR's in bfloat16 too; unset, the checkpoint's; a name that is
    not an implementation stops with the list."""
    app = load_app()
    monkeypatch.setenv("MARS_MODEL", str(save_checkpoint(tmp_path / "ckpt")))
    monkeypatch.setenv("MARS_DTYPE", "bfloat16")
    model, _ = app.load_model()
    assert model.config._attn_implementation == "sdpa"
    monkeypatch.setenv("MARS_ATTENTION", "ordered")
    model, _ = app.load_model()
    assert model.config._attn_implementation == "ordered"
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert {type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear)} == {"OrderedLinear"}
    monkeypatch.setenv("MARS_ATTENTION", "flash")
    with pytest.raises(SystemExit, match="MARS_ATTENTION must be one of sdpa, eager, ordered"):
        app.load_model()


def test_auto_dtype_is_measured_here_and_said(tmp_path, monkeypatch, capsys):
    """MARS_DTYPE=auto: hf_mars's timing tools measure pass costs in float32 and bfloat16 on this machine (in a
    fresh cache), loads the model in the dtype it chose, says why, and the page and the lossless control say so."""
    app = load_app()
    monkeypatch.setenv("HF_MARS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MARS_MODEL", str(save_checkpoint(tmp_path / "ckpt")))
    monkeypatch.setenv("MARS_DTYPE", "auto")
    model, tokenizer = app.load_model()
    said = capsys.readouterr().err
    chosen = str(model.dtype).removeprefix("torch.")
    assert f"MARS_DTYPE=auto: dtype {chosen}: expected lossless for a 256-token prompt" in said
    assert "float32 " in said and "bfloat16 " in said and "prompt " in said  # both dtypes, the prompt's cost
    assert (tmp_path / "cache" / "pass_costs.json").is_file()  # measured here, not assumed
    texts = [c["props"].get("value") for c in app.build_demo(model, tokenizer).config["components"]]
    header = next(text for text in texts if isinstance(text, str) and text.startswith("# MARS"))
    assert f"*{chosen} on cpu.*" in header
