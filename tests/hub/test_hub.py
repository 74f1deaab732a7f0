"""Publishing to the Hub, against a fake Hub on 127.0.0.1 (tests/fake_hub.py): what arrives, the card, and loading.

Uploads run in-process (huggingface_hub pointed at the fake through its constants) and, for the CLI, in a subprocess
with HF_ENDPOINT set, as a user runs it. Loading runs in a subprocess where hf_mars cannot be imported.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from fake_hub import FakeHub
from helpers import make_model, make_tokenizer
from huggingface_hub import HfApi, ModelCard, constants

import hf_mars
from hf_mars.decoding import REMOTE_FILES, costs
from hf_mars.hub import (
    SPACE_FOLDER,
    check_mars_folder,
    load_tau_table,
    push_space,
    push_to_hub,
    render_model_card,
    space_files,
    tau_table_markdown,
)

TOKEN = "hf_fake_test_token"
TAU_TABLE = {
    "setup": "toy counting task, CPU, batch 1",
    "rows": [
        {"tau": 1.0, "tokens_per_forward": 1.0, "accuracy": 0.5, "speedup": 1.0},
        {"tau": 0.9, "tokens_per_forward": 2.0, "accuracy": 0.44, "speedup": 1.68},
    ],
}
CHECKPOINT_FILES = {
    "model.safetensors",
    "config.json",
    "generation_config.json",
    *REMOTE_FILES,
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
}


def save_checkpoint(path, extras=True):
    """A tiny MARS checkpoint as hf_mars saves it, plus what a training run leaves next to it."""
    tok, model = make_tokenizer(), make_model("qwen2")
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # peaked distributions: masks get accepted at τ = 0.9
    hf_mars.to_mars(model, tok, block_size=4)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    if extras:
        (path / "training_args.bin").write_bytes(b"pickle")
        (path / "optimizer.pt").write_bytes(b"pickle")
        (path / "trainer_state.json").write_text("{}")
        (path / "README.md").write_text("---\nlicense: mit\nbase_model: some-org/base-model\n---\n# my notes\n")
    return model, tok


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    model, tok = save_checkpoint(path)
    return path, model, tok


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The fake Hub, with this process's huggingface_hub pointed at it and online; `hub.env` is for subprocesses."""
    with FakeHub() as fake:
        monkeypatch.setattr(constants, "ENDPOINT", fake.url)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # CI exports HF_HUB_OFFLINE=1
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        fake.env = env | {
            "HF_ENDPOINT": fake.url,
            "HF_HOME": str(tmp_path / "hf_home"),
            "HF_TOKEN": TOKEN,
            "NO_PROXY": "127.0.0.1",
            "OMP_NUM_THREADS": "1",
        }
        yield fake


def run(args, env, code=None):
    cmd = [sys.executable, "-c", code] if code is not None else [sys.executable, "-m", "hf_mars.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def repo_requests(hub):
    return [r for r in hub.requests if r[1] != "/api/agent-harnesses"]


def test_push_uploads_a_checkpoint_that_loads_from_the_hub(hub, checkpoint):
    path, model, tok = checkpoint
    result = push_to_hub(
        path,
        "me/tiny-mars",
        private=True,
        revision="v1",
        license="apache-2.0",
        datasets=["gsm8k"],
        tau_table=TAU_TABLE,
    )

    repo = hub.repo("me/tiny-mars")
    files = repo.files("v1")
    assert set(files) == CHECKPOINT_FILES | {"README.md", ".gitattributes"}  # no pickles, no trainer state
    assert set(repo.files("main")) == {".gitattributes"}  # the branch was created; main is untouched
    assert [c["summary"] for c in repo.commits] == ["initial commit", "Upload MARS checkpoint"]  # one commit
    for name in CHECKPOINT_FILES - {"tokenizer_config.json"}:
        assert files[name] == (path / name).read_bytes()
    # The tokenizer's config as transformers 4 reads it too; the same settings otherwise
    sent, saved = json.loads(files["tokenizer_config.json"]), json.loads((path / "tokenizer_config.json").read_text())
    assert sent["tokenizer_class"] == "PreTrainedTokenizerFast" and "extra_special_tokens" not in sent
    assert set(saved["extra_special_tokens"]) <= set(sent["additional_special_tokens"])
    assert {k: v for k, v in sent.items() if k not in ("tokenizer_class", "additional_special_tokens")} == {
        k: v for k, v in saved.items() if k not in ("tokenizer_class", "extra_special_tokens")
    }
    assert hub.create_payloads == [
        {"name": "tiny-mars", "organization": "me", "visibility": "private", "type": "model"}
    ]
    assert repo.private
    assert all(auth == f"Bearer {TOKEN}" for _, _, auth in repo_requests(hub))  # HF_TOKEN, as huggingface_hub reads it
    assert hub.unhandled == []

    # What the result (and the CLI) reports is what arrived.
    assert dict(result.uploaded) == {name: len(files[name]) for name in CHECKPOINT_FILES | {"README.md"}}
    assert result.commit_sha == repo.branches["v1"] and result.commit_url.endswith(
        f"/me/tiny-mars/commit/{result.commit_sha}"
    )
    skipped = dict(result.skipped)
    assert "pickle" in skipped["training_args.bin"] and "pickle" in skipped["optimizer.pt"]
    assert set(skipped) == {"training_args.bin", "optimizer.pt", "trainer_state.json", "README.md"}

    # The card: Hub metadata (arguments win over the folder's own README.md, which fills the gaps), τ table, usage.
    card = ModelCard(files["README.md"].decode())
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert card.data.tags == ["mars", "multi-token-prediction"]
    assert card.data.license == "apache-2.0" and card.data.datasets == ["gsm8k"]
    assert card.data.base_model == "some-org/base-model"
    assert (
        "| τ | tokens / forward | accuracy | speedup |" in card.text and "| 0.90 | 2.00 | 0.44 | 1.68 |" in card.text
    )
    assert "toy counting task, CPU, batch 1" in card.text and "pin a revision" in card.text.lower()
    snippet = re.search(r"```python\n(.*?)```", card.text, re.S)[1]
    assert 'revision = "v1"' in snippet and "trust_remote_code=True" in snippet and "mars_tau=0.9" in snippet

    # The card's snippet, run as written against the (private) fake Hub in a process without hf_mars.
    check = "\nimport json\nprint(json.dumps(dict(cls=type(model).__name__, seq=out.sequences[0].tolist())))\n"
    loaded = run(None, hub.env, "import sys; sys.modules['hf_mars'] = None\n" + snippet + check)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    out = json.loads(loaded.stdout.strip().splitlines()[-1])
    expected = model.generate(
        **tok("The capital of France is", return_tensors="pt"),
        mars_tau=0.9,
        max_new_tokens=64,
        return_dict_in_generate=True,
    )
    assert out["cls"] == "MARSQwen2ForCausalLM" and out["seq"] == expected.sequences[0].tolist()
    assert expected.mars_stats.forward_passes < 64  # several tokens per pass: the test exercises MARS decoding
    assert "tokens per forward pass" in loaded.stdout

    # Pushing again to the same branch reuses the repo and the branch.
    push_to_hub(path, "me/tiny-mars", revision="v1", commit_message="again")
    assert [c["summary"] for c in repo.commits][-1] == "again" and len(hub.create_payloads) == 2


def test_cli_push_prints_what_was_uploaded(hub, checkpoint, tmp_path):
    path = checkpoint[0]
    (tmp_path / "tau.json").write_text(json.dumps(TAU_TABLE["rows"]))
    result = run(
        ["push", str(path), "me/cli-mars", "--tau-table", str(tmp_path / "tau.json"), "--base-model", "org/x"], hub.env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    repo = hub.repo("me/cli-mars")
    sha = repo.branches["main"]
    assert f"{hub.url}/me/cli-mars/commit/{sha}" in result.stdout
    assert re.search(r"model\.safetensors\s+439\.2 KB", result.stdout) and "README.md" in result.stdout
    assert "skipped training_args.bin: pickle file" in result.stdout
    assert f"revision='{sha}'" in result.stdout  # the exact commit, to pin
    assert "visibility" not in hub.create_payloads[0]  # no --private: the Hub's default
    card = ModelCard(repo.files()["README.md"].decode())
    assert card.data.base_model == "org/x" and card.data.license == "mit"  # argument, then the folder's README
    assert "| 1.00 | 1.00 | 0.5 | 1 |" in card.text and 'revision = "main"' in card.text
    assert all(auth == f"Bearer {TOKEN}" for _, _, auth in repo_requests(hub))

    plain = tmp_path / "plain"  # a model that is not MARS: refused before anything is sent
    make_model("llama").save_pretrained(plain)
    before = len(repo_requests(hub))
    refused = run(["push", str(plain), "me/nope"], hub.env)
    assert refused.returncode != 0 and "not a MARS checkpoint" in refused.stderr and "Traceback" not in refused.stderr
    assert len(repo_requests(hub)) == before


def _remove(path, name):
    (path / name).unlink()


def _edit_json(name, **changes):
    def edit(path):
        data = json.loads((path / name).read_text())
        for key, value in changes.items():
            data.pop(key) if value is None else data.__setitem__(key, value)
        (path / name).write_text(json.dumps(data))

    return edit


def _pickled_weights(path):
    (path / "model.safetensors").rename(path / "pytorch_model.bin")


def _sharded_missing(path):
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
    )


@pytest.mark.parametrize(
    "damage, message",
    [
        (_edit_json("config.json", mars_mask_token_id=None), "not a MARS checkpoint"),
        (_edit_json("config.json", auto_map=None), "no auto_map entry"),
        (lambda p: _remove(p, "generate.py"), r"remote-code files \['generate.py'\]"),
        (_edit_json("generation_config.json", mars_block_size=None), "MARS defaults"),
        (_pickled_weights, r"no safetensors weights \(found pickle files \[.*'pytorch_model.bin'.*never uploaded"),
        (_sharded_missing, "shards that are not there"),
        (lambda p: _remove(p, "tokenizer.json"), "no tokenizer"),
        (lambda p: _remove(p, "config.json"), "no config.json"),
    ],
)
def test_push_refuses_incomplete_folders_before_sending_anything(hub, checkpoint, damage, message):
    path = checkpoint[0]
    damage(path)
    with pytest.raises(ValueError, match=message):
        push_to_hub(path, "me/broken")
    assert repo_requests(hub) == []
    with pytest.raises(ValueError, match="not a folder"):
        check_mars_folder(path / "nowhere")


def test_private_push_into_an_existing_public_repo_is_refused(hub, checkpoint):
    HfApi().create_repo("me/public")
    with pytest.raises(ValueError, match="already exists and is public"):
        push_to_hub(checkpoint[0], "me/public", private=True)
    assert len(hub.repo("me/public").commits) == 1  # nothing committed


def test_card_metadata_is_never_invented(checkpoint):
    path = checkpoint[0]
    (path / "README.md").unlink()
    card = render_model_card(path, "me/x")
    assert card.data.base_model is None and card.data.license is None and card.data.datasets is None
    assert "base_model" not in str(card) and "license" not in str(card) and "Measured speed" not in str(card)
    for name_or_path, expected in [
        (str(path), None),
        ("./local", None),
        ("me/x", None),
        ("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B"),
    ]:
        _edit_json("config.json", _name_or_path=name_or_path)(path)
        assert render_model_card(path, "me/x").data.base_model == expected


def test_tau_table_forms_and_errors(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps(TAU_TABLE))
    table = load_tau_table(tmp_path / "t.json")
    assert table == {"rows": TAU_TABLE["rows"], "setup": TAU_TABLE["setup"]} == load_tau_table(TAU_TABLE)
    assert load_tau_table(TAU_TABLE["rows"])["setup"] is None
    markdown = tau_table_markdown(load_tau_table([{"tokens_per_forward": 3.25, "tau": 0.7, "same_as_ar": "59%"}]))
    assert (
        markdown.splitlines()[0] == "| τ | tokens / forward | same as ar |"
        and markdown.splitlines()[2] == "| 0.70 | 3.25 | 59% |"
    )
    for bad, message in [
        ([], "non-empty"),
        ([{"tau": 0.9}], "tokens_per_forward"),
        ([{"tau": 1.5, "tokens_per_forward": 1}], "tau must"),
        ([{"tau": 0.9, "tokens_per_forward": 0}], "positive"),
        (tmp_path / "missing.json", "Cannot read"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_tau_table(bad)


def space_folder(tmp_path, sdk="gradio"):
    folder = tmp_path / "space"
    (folder / "__pycache__").mkdir(parents=True)
    (folder / "app.py").write_text("import os\nMODEL = os.environ['MARS_MODEL']\n")
    (folder / "requirements.txt").write_text("transformers\n")
    (folder / "README.md").write_text(f"---\ntitle: MARS demo\nsdk: {sdk}\napp_file: app.py\n---\nDemo\n")
    (folder / "__pycache__" / "app.cpython-311.pyc").write_bytes(b"\0")
    return folder


def test_push_space_uploads_the_folder_and_points_it_at_the_model(hub, tmp_path):
    folder = space_folder(tmp_path)
    with pytest.raises(ValueError, match="not found on the Hub"):
        push_space("me/demo", "me/missing-model", folder=folder)
    assert not any(kind == "space" for kind, _ in hub.repos)

    HfApi().create_repo("me/model")
    result = push_space("me/demo", "me/model", folder=folder, model_revision="main")
    space = hub.repo("me/demo", "space")
    assert hub.create_payloads[-1] == {"name": "demo", "organization": "me", "type": "space", "sdk": "gradio"}
    timing = {path for path in space.files() if path.startswith("hf_mars/")}  # hf_mars's timing tools
    assert {
        "hf_mars/decoding/costs.py",
        "hf_mars/tools/measure/passes.py",
        "hf_mars/tools/measure/dtypes.py",
    } <= timing
    assert set(space.files()) - timing == {".gitattributes", "app.py", "requirements.txt", "README.md"}  # no cache
    assert space.files()["app.py"] == (folder / "app.py").read_bytes()
    assert space.files()["hf_mars/decoding/costs.py"] == Path(costs.__file__).read_bytes()
    assert space.variables == {"MARS_MODEL": "me/model", "MARS_REVISION": "main"}
    assert {p for p, _ in result.uploaded} == {"app.py", "requirements.txt", "README.md"} | timing
    assert result.commit_url == f"{hub.url}/spaces/me/demo/commit/{space.branches['main']}"
    assert all(auth == f"Bearer {TOKEN}" for _, _, auth in repo_requests(hub))

    with pytest.raises(ValueError, match="sdk: streamlit"):
        push_space("me/demo", "me/model", folder=space_folder(tmp_path / "s", sdk="streamlit"))
    (folder / "app.py").unlink()
    with pytest.raises(ValueError, match="no app.py"):
        push_space("me/demo", "me/model", folder=folder)


@pytest.mark.skipif(not (SPACE_FOLDER / "app.py").is_file(), reason="the project's spaces_demo/ is not there")
def test_push_space_publishes_the_projects_space_folder_by_default(hub):
    HfApi().create_repo("me/model")
    push_space("me/live", "me/model")
    files = hub.repo("me/live", "space").files()
    expected = {
        p.relative_to(SPACE_FOLDER).as_posix()
        for p in SPACE_FOLDER.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and not p.name.startswith(".") and p.suffix != ".pyc"
    }
    timing = {name for name in files if name.startswith("hf_mars/")}
    assert {"app.py", "README.md"} <= expected and set(files) == expected | timing | {".gitattributes"}
    assert all(files[name] == (SPACE_FOLDER / name).read_bytes() for name in expected)


def test_the_space_s_timing_tools_run_on_their_own(tmp_path):
    """What `push_space` puts beside the app under hf_mars/ is all that `hf_mars.measure` and `hf_mars.choose_dtype`
    import: in a folder holding only the Space's files, they load from there and time the passes of a checkpoint
    loaded with its own code, as the Space's app does at its start."""
    files, _ = space_files(space_folder(tmp_path / "space"))
    for path, local in files:
        (tmp_path / "staged" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "staged" / path).write_bytes(local.read_bytes())
    save_checkpoint(tmp_path / "ckpt", extras=False)
    code = textwrap.dedent(
        f"""
        import os, hf_mars, transformers
        assert hf_mars.__file__.startswith(os.getcwd()), hf_mars.__file__
        model = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path / "ckpt")!r}, trust_remote_code=True)
        model.generation_config.mars_acceptance, model.generation_config.mars_lossless = {{"2x1": 1.5}}, "auto"
        print(hf_mars.choose_dtype(model, prompt_tokens=8, new_tokens=8).reason())
        print(hf_mars.measure(model, [1], mars_verify=True))
        """
    )
    # HF_MARS_TIME_BUSY: timed even where other work holds the CPU, as it may while tests run (the timing is not
    # what this test measures)
    env = dict(os.environ, HF_MARS_CACHE=str(tmp_path / "cache"), HF_MARS_TIME_BUSY="1")
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path / "staged", env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "expected lossless for a 8-token prompt" in done.stdout and "mars_block_size" in done.stdout
    assert (tmp_path / "cache" / "pass_costs.json").is_file()


def test_push_space_without_a_folder_outside_a_checkout_names_what_is_missing(hub, monkeypatch, tmp_path):
    """An installed wheel has no spaces_demo/ (tests/hub/test_wheel.py runs it for real): one clear error, nothing
    sent."""
    import hf_mars.hub

    monkeypatch.setattr(hf_mars.hub, "SPACE_FOLDER", tmp_path / "site-packages" / "spaces_demo")
    with pytest.raises(
        ValueError, match=r"spaces_demo/ \(.*\), is not there.*pass folder= \(hf-mars push-space --folder DIR\)"
    ):
        push_space("me/demo", "me/model")
    assert repo_requests(hub) == []


def test_cli_push_space(hub, tmp_path):
    HfApi().create_repo("me/model")
    folder = space_folder(tmp_path)
    push_space("me/demo", "me/model", folder=folder, model_revision="main")  # a pin the next push must not keep
    result = run(["push-space", "me/demo", "--model", "me/model", "--folder", str(folder)], hub.env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert hub.repo("me/demo", "space").variables == {"MARS_MODEL": "me/model"}
    assert "Space variable MARS_MODEL=me/model" in result.stdout and "/spaces/me/demo/commit/" in result.stdout


def test_a_model_pushed_by_save_pretrained_names_its_base_class_for_serving_engines(hub, tmp_path):
    """transformers' own `save_pretrained(push_to_hub=True)` uploads what the folder holds: the base class in
    `architectures` (vLLM serves the checkpoint by it) and the MARS class in `auto_map`."""
    model, _ = save_checkpoint(tmp_path / "local", extras=False)
    model.save_pretrained(tmp_path / "direct", push_to_hub=True, repo_id="me/direct", token=TOKEN)
    for config in (
        json.loads(hub.repo("me/direct").files()["config.json"]),
        json.loads((tmp_path / "direct" / "config.json").read_text()),
    ):
        assert config["architectures"] == ["Qwen2ForCausalLM"] and config["mask_token_id"] == 259
        assert config["auto_map"]["AutoModelForCausalLM"] == "modeling.MARSQwen2ForCausalLM"
    assert set(REMOTE_FILES) <= set(hub.repo("me/direct").files())
