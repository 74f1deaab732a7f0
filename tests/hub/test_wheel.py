"""hf_mars as a user gets it: a wheel built from this checkout, installed into a fresh virtual environment, and
`hf-mars push` run from there against the fake Hub (tests/hub/fake_hub.py).

What a source checkout hides: files read from outside the package (the repository root) are missing from an
installed wheel. The model-card template is package data (`hf_mars/templates/model_card.md`); the Space folder
(`spaces_demo/`) is not shipped, and `push-space` without `--folder` must say so in one line.

The build runs from a copy of src/ and pyproject.toml in a temporary folder, so nothing (build/, egg-info) is written
into the working tree. The venv sees this interpreter's packages (torch, transformers, ...) but its own hf_mars, and
the test checks that the wheel's hf_mars, not the editable source, is the one imported.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from fake_hub import FakeHub
from helpers import make_model, make_tokenizer

import hf_mars
from hf_mars.hub import MODEL_CARD_TEMPLATE, render_model_card

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_fake_test_token"
TEMPLATE_PATH = "hf_mars/templates/model_card.md"


def _run(cmd, **kwargs):
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel `pip wheel` builds from a copy of this checkout (no network, no build isolation: setuptools from
    the dev extras)."""
    tmp = tmp_path_factory.mktemp("wheel")
    project = tmp / "project"
    shutil.copytree(ROOT / "src", project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, project / name)
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            tmp / "dist",
            project,
        ]
    )
    (built,) = (tmp / "dist").glob("hf_mars-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    """A fresh venv with the wheel installed; returns (python, hf-mars script, environment for subprocesses)."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", root])
    python = root / "bin" / "python"
    # The venv's site-packages come first; then this interpreter's (which hold torch etc. also when it runs in a
    # venv itself, whose packages --system-site-packages alone would not show). Its editable hf_mars comes later.
    purelib = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    outer = [p for p in dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"]]) if Path(p).is_dir()]
    (purelib / "_hf_mars_test_outer.pth").write_text(f"import site; list(map(site.addsitedir, {outer!r}))\n")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    env |= {"PYTHONNOUSERSITE": "1", "OMP_NUM_THREADS": "1", "HF_HOME": str(root.parent / "hf_home")}
    # Its pip is this interpreter's (seen through the .pth). --force-reinstall: the same version is already
    # installed (editable) outside the venv; pip leaves that one alone ("outside environment").
    _run(
        [python, "-m", "pip", "install", "--no-deps", "--no-index", "--force-reinstall", "-q", wheel],
        env=env,
        cwd=root.parent,
    )
    return python, root / "bin" / "hf-mars", env


def test_the_wheel_ships_the_template_and_the_checkpoint_delta_and_nothing_of_the_repository(wheel):
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        assert whl.read(TEMPLATE_PATH) == MODEL_CARD_TEMPLATE.read_bytes()
    shipped = ROOT / "src" / "hf_mars" / "checkpoints"
    expected = {f"hf_mars/{p.relative_to(shipped.parent).as_posix()}" for p in shipped.glob("*/*") if p.is_file()}
    assert expected and expected <= names  # the 19.6 MB delta `hf-mars generate` builds the checkpoint from
    assert not any(n.startswith(("model_cards/", "spaces_demo/", "tests/")) for n in names)
    assert "hf_mars/hub.py" in names and "hf_mars/cli/__init__.py" in names


def test_push_from_the_installed_wheel_renders_the_model_card(venv, tmp_path):
    python, hf_mars_script, env = venv
    # The venv imports the wheel's hf_mars, and its template is the package's own file, not the checkout's.
    where = _run(
        [
            python,
            "-c",
            "import json, hf_mars, hf_mars.hub as h; "
            "print(json.dumps([hf_mars.__file__, str(h.MODEL_CARD_TEMPLATE), h.MODEL_CARD_TEMPLATE.is_file()]))",
        ],
        env=env,
        cwd=tmp_path,
    )
    module, template, exists = json.loads(where.stdout.strip().splitlines()[-1])
    venv_root = python.parent.parent
    assert Path(module).is_relative_to(venv_root) and not Path(module).is_relative_to(ROOT)
    assert Path(template) == Path(module).parent / "templates" / "model_card.md" and exists

    # A tiny MARS checkpoint, pushed with the venv's `hf-mars push`: the card arrives rendered from the template.
    folder = tmp_path / "ckpt"
    tok, model = make_tokenizer(), make_model("qwen2")
    hf_mars.to_mars(model, tok, block_size=4)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    with FakeHub() as hub:
        hub_env = env | {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "NO_PROXY": "127.0.0.1"}
        result = subprocess.run(
            [hf_mars_script, "push", str(folder), "me/wheel-mars", "--license", "apache-2.0"],
            capture_output=True,
            text=True,
            timeout=600,
            env=hub_env,
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        card = hub.repo("me/wheel-mars").files()["README.md"].decode()

        # push-space with no --folder: the wheel has no spaces_demo/; one line says so and how to pass one.
        refused = subprocess.run(
            [hf_mars_script, "push-space", "me/demo", "--model", "me/wheel-mars"],
            capture_output=True,
            text=True,
            timeout=600,
            env=hub_env,
            cwd=tmp_path,
        )
        assert refused.returncode != 0 and "Traceback" not in refused.stderr
        message = refused.stderr.strip()
        assert len(message.splitlines()) == 1 and "spaces_demo" in message and "--folder" in message
        assert not any(kind == "space" for kind, _ in hub.repos)

    assert "# me/wheel-mars" in card and "A **MARS** (Mask AutoRegression" in card and "trust_remote_code=True" in card
    assert "{{" not in card and "{%" not in card  # rendered, not copied
    assert card == str(render_model_card(folder, "me/wheel-mars", license="apache-2.0"))  # as from the checkout
