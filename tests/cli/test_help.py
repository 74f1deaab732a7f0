"""`hf-mars --help` answers at once and lists every command: building the parsers imports neither torch nor
transformers (they took seconds to import before the first line of help)."""

from __future__ import annotations

import argparse
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


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, by name, as `hf-mars` builds them (train, recipe and distill: only the arguments
    argparse reads; TRL's parser reads their dataclass options inside `run`)."""
    from hf_mars.cli import build_parser

    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices


def has_default(action: argparse.Action) -> bool:
    return not any(action.default is none for none in (None, False, argparse.SUPPRESS))  # 0 == False: `is`


def test_every_option_has_help_and_every_default_is_shown():
    commands = command_parsers()
    assert sorted(commands) == sorted(COMMANDS)
    undocumented, silent = [], []
    for name, command in commands.items():
        command.format_help()  # renders (a stray % in a help string would raise)
        formatter = command._get_formatter()
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = f"{name} {'/'.join(action.option_strings) or action.dest}"
            if not (action.help or "").strip():
                undocumented.append(flag)
            elif has_default(action):
                shown = formatter._expand_help(action)  # the action's help as --help prints it
                if "default" not in shown.lower() and str(action.default) not in shown:
                    silent.append(flag)
    assert undocumented == [], f"options without help: {undocumented}"
    assert silent == [], f"options whose --help does not show their default: {silent}"


def rendered(command: str) -> str:
    return " ".join(command_parsers()[command].format_help().split())  # whitespace as wrapping left it, one space


def test_help_shows_defaults_once():
    from hf_mars.cli.generate import DEFAULT_PROMPT

    serve, generate = rendered("serve"), rendered("generate")
    assert "port to listen on (default: 8000)" in serve
    assert "drafts per step, K (default 3;" in serve and "(default: 3)" not in serve  # said by the help already
    assert f"in the chat template unless --raw (default: {DEFAULT_PROMPT})" in generate
    assert "most tokens to generate, each run (default: 256)" in generate
    assert "(default: 0.0)" in generate  # --mask-cost: a default equal to False is still shown
    assert "(default: 1 4 8 16)" in rendered("bench")  # lists as they are typed


def test_help_keeps_the_api_key_from_the_environment_out(monkeypatch):
    monkeypatch.setenv("HF_MARS_API_KEY", "sk-not-for-the-screen")
    assert "sk-not-for-the-screen" not in rendered("serve")
