"""A checkpoint the CLI cannot load is refused in one line that says what is wrong and what to do: no traceback, and
no waiting on retries when the Hub is offline or unreachable."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading

import pytest
from helpers import make_model, make_tokenizer

import hf_mars
from hf_mars.tools.checkpoints import loading
from hf_mars.tools.checkpoints.loading import CheckpointError, check_mars_config, resolve_checkpoint


def hf_mars_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "hf_mars.cli", *args], capture_output=True, text=True, timeout=600, env=env
    )


def one_line(result) -> str:
    """The refusal: exit status 1 and a single line on stderr."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return lines[0]


def online(tmp_path, endpoint: str) -> dict:
    """A subprocess environment with the Hub online at `endpoint` and an empty Hugging Face cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    return env | {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf_home"), "NO_PROXY": "127.0.0.1"}


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tok = make_tokenizer()
    model = hf_mars.to_mars(make_model("qwen2"), tok, block_size=4)
    folder = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_a_missing_folder_is_named_as_missing(tmp_path):
    for name in ("/nonexistent/folder", str(tmp_path / "nope"), "./no-such-folder", "~/no/such/folder"):
        line = one_line(hf_mars_cli("generate", name))
        assert line == (
            f"hf-mars: {name} does not exist: pass a MARS checkpoint folder or a Hub repo id (namespace/name)."
        )


def test_a_folder_or_file_that_is_no_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    assert "holds no config.json" in one_line(hf_mars_cli("generate", str(tmp_path / "empty")))
    (tmp_path / "model.safetensors").write_bytes(b"")
    line = one_line(hf_mars_cli("bench", str(tmp_path / "model.safetensors")))
    assert "is a file: pass the checkpoint's folder" in line


def test_a_hub_id_while_offline_says_so_at_once(tmp_path):
    env = online(tmp_path, "http://127.0.0.1:9") | {"HF_HUB_OFFLINE": "1"}
    line = one_line(hf_mars_cli("generate", "no-such-org/no-such-model", env=env))
    assert "HF_HUB_OFFLINE is set" in line and "no copy of it in the Hugging Face cache" in line


def test_an_unreachable_hub_is_one_line_without_retries(tmp_path):
    """A Hub that hangs up on every request is asked once: the CLI refuses at once instead of retrying (a download
    retries for tens of seconds). Counted, not timed: a busy machine may take long to start the CLI."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        asked, done = [], threading.Event()

        def hang_up():
            while not done.is_set():
                try:
                    connection, _ = server.accept()
                except TimeoutError:
                    continue
                connection.settimeout(5)
                try:
                    asked.append(connection.recv(4096).split(b"\r\n")[0].decode())
                except OSError:
                    asked.append("")
                connection.close()

        thread = threading.Thread(target=hang_up, daemon=True)
        thread.start()
        endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
        try:
            result = hf_mars_cli("generate", "no-such-org/no-such-model", env=online(tmp_path, endpoint))
        finally:
            done.set()
            thread.join()
    line = one_line(result)
    assert line.startswith("hf-mars: cannot reach the Hugging Face Hub to download no-such-org/no-such-model (")
    assert "check the connection" in line
    repo = [request for request in asked if "/api/models/no-such-org/no-such-model" in request]
    assert len(repo) == 1, asked


def cache_copy(checkpoint, hf_home, repo_id: str) -> None:
    """`checkpoint` as huggingface_hub's cache holds a downloaded repo: a snapshot folder and refs/main."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    shutil.copytree(checkpoint, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_a_cached_hub_id_loads_offline_and_when_the_hub_is_unreachable(checkpoint, tmp_path):
    env = online(tmp_path, f"http://127.0.0.1:{closed_port()}")
    cache_copy(checkpoint, tmp_path / "hf_home", "me/tiny-mars")
    for extra in ({"HF_HUB_OFFLINE": "1"}, {}):
        result = hf_mars_cli("generate", "me/tiny-mars", "--max-new-tokens", "4", "--no-compare", env=env | extra)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "forward passes" in result.stderr


def test_a_checkpoint_that_is_not_mars_points_to_convert_and_to_mars(tmp_path):
    make_model("llama").save_pretrained(tmp_path / "plain")
    make_tokenizer().save_pretrained(tmp_path / "plain")
    line = one_line(hf_mars_cli("generate", str(tmp_path / "plain"), "--prompt", "x"))
    assert f"hf-mars: {tmp_path / 'plain'} is not a MARS checkpoint (no mars_mask_token_id in its config)" in line
    assert "hf_mars.to_mars(model, tokenizer)" in line and "hf-mars convert" in line
    with pytest.raises(CheckpointError, match="model_type a2d-qwen2.*hf-mars convert SRC DST"):
        check_mars_config({"model_type": "a2d-qwen2", "mars_mask_token_id": 5}, "authors/MARS")
    check_mars_config({"model_type": "qwen2", "mars_mask_token_id": 5}, "ok")  # a MARS config passes


def test_resolve_checkpoint_answers_without_the_hub(checkpoint, monkeypatch):
    assert resolve_checkpoint(str(checkpoint)) == str(checkpoint)
    with pytest.raises(CheckpointError, match="neither a local folder nor a Hub repo id"):
        resolve_checkpoint("bad name!")
    monkeypatch.setattr(loading, "_ask_hub", lambda *a: pytest.fail("offline: the Hub must not be asked"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr(loading, "_cached_snapshot", lambda repo_id, revision: None)
    with pytest.raises(CheckpointError, match="HF_HUB_OFFLINE is set"):
        resolve_checkpoint("me/not-cached")
    assert issubclass(CheckpointError, ValueError)  # the CLI prints ValueErrors as one line
    assert hf_mars.load_checkpoint is loading.load_checkpoint and hf_mars.CheckpointError is CheckpointError


def test_load_checkpoint_gives_a_mars_model(checkpoint):
    import torch

    model, tok = hf_mars.load_checkpoint(str(checkpoint), dtype="bfloat16")
    assert type(model).__name__.startswith("MARS") and model.dtype == torch.bfloat16 and not model.training
    assert tok.convert_tokens_to_ids(hf_mars.MASK_TOKEN) == model.config.mars_mask_token_id
    saved = json.loads((checkpoint / "config.json").read_text())
    assert saved["mars_mask_token_id"] == model.config.mars_mask_token_id
