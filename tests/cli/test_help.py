"""`hf-mars --help` answers at once and lists every command: building the parsers imports neither torch nor
transformers (they took seconds to import before the first line of help)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

COMMANDS = [
    "generate",
    "serve",
    "train",
    "demo",
    "bench",
    "tune",
    "distill",
    "export-delta",
    "eval",
    "recipe",
    "convert",
    "push",
    "push-space",
]

# Parses each --help in one interpreter, then reports which heavy modules got imported along the way.
PROBE = """
import contextlib, io, json, sys
from hf_mars.cli import main
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main(argv)
heavy = {"torch", "transformers", "trl", "huggingface_hub"}
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules} & heavy)))
"""


# Commands whose options TRL's parser reads from dataclasses: their --help loads TRL and transformers (not torch).
TRL_PARSED = ("train", "recipe", "distill")


def probe(argvs: list[list[str]]) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argvs)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_help_imports_neither_torch_nor_transformers():
    assert probe([["--help"]] + [[command, "--help"] for command in COMMANDS if command not in TRL_PARSED]) == []


def test_recipe_and_distill_help_lists_their_dataclass_defaults_without_torch():
    assert "torch" not in probe([["recipe", "--help"], ["distill", "--help"]])
    result = subprocess.run(
        [sys.executable, "-m", "hf_mars.cli", "distill", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "--prompts PROMPTS" in result.stdout and "(default: 1000)" in result.stdout and "--config" in result.stdout


def test_help_lists_every_command_with_a_one_line_description():
    env = {**os.environ, "COLUMNS": "80"}
    result = subprocess.run(
        [sys.executable, "-m", "hf_mars.cli", "--help"], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: hf-mars [-h] COMMAND ...")
    lines = result.stdout.split("\ncommands:\n")[1].split("\n\n")[0].splitlines()
    assert lines[0].strip() == "COMMAND"
    listed = [line.split(None, 1) for line in lines[1:]]
    assert [name for name, _ in listed] == COMMANDS  # one line each: a wrapped description would add a line
    assert all(len(help.split()) >= 4 for _, help in listed)
