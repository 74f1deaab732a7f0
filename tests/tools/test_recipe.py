"""The recipe of the shipped checkpoint: training prompts, self-distillation, the training set, scoring, τ table."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from helpers import make_model, make_tokenizer
from safetensors.torch import load_file
from transformers import GenerationMixin

from hf_mars.cli.recipe import parse_settings
from hf_mars.tools.data.distillation import distill, write_reference_set, write_training_set
from hf_mars.tools.data.sourcing import training_prompts
from hf_mars.tools.evaluate.eval_sets import humaneval
from hf_mars.tools.evaluate.evals import (
    format_tau_table,
    gsm8k_correct,
    humaneval_correct,
    tau_table,
)
from hf_mars.tools.recipe import steps as recipe
from hf_mars.tools.recipe.settings import DistillSettings, Recipe
from hf_mars.training.trainer import MARSTrainer


def test_reference_set_has_the_prompts_of_the_training_set(tmp_path):
    prompts = training_prompts(20, seed=1)
    train = [
        {"messages": [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": f"own {i}"}]}
        for i, p in enumerate(prompts[::2])
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    assert write_reference_set(tmp_path / "train.jsonl", prompts, tmp_path / "ref.jsonl") == len(train)
    ref = [json.loads(line) for line in (tmp_path / "ref.jsonl").open()]
    assert [r["messages"][0] for r in ref] == [r["messages"][0] for r in train]
    assert [r["messages"][1]["content"] for r in ref] == [p["reference"] for p in prompts[::2]]
    with pytest.raises(ValueError, match="not among the given prompts"):
        write_reference_set(tmp_path / "train.jsonl", prompts[1::2], tmp_path / "ref.jsonl")


def test_distill_answers_with_the_model_resumes_and_keeps_finished_answers(tmp_path):
    tok = make_tokenizer()
    model = make_model("llama")
    prompts = [{"prompt": f"count {i} {i + 1}", "source": "toy"} for i in range(5)]
    out = tmp_path / "distilled.jsonl"
    distill(model, tok, prompts[:3], out, max_new_tokens=6, batch_size=2)
    distill(model, tok, prompts, out, max_new_tokens=6, batch_size=2)  # resumes: only the last two are new
    rows = [json.loads(line) for line in out.open()]
    assert sorted(r["messages"][0]["content"] for r in rows) == sorted(p["prompt"] for p in prompts)
    # The answers are the model's own greedy continuations
    row = rows[0]
    chat = tok.apply_chat_template(
        row["messages"][:1], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    greedy = model.generate(**chat, max_new_tokens=6, do_sample=False)[0, chat["input_ids"].shape[1] :]
    assert tok.decode(greedy, skip_special_tokens=True).strip() == row["messages"][1]["content"]
    assert row["finished"] == bool((greedy == tok.eos_token_id).any())

    rows[0]["finished"], rows[1]["finished"] = True, False
    rows[0]["messages"][1]["content"] = "done"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept, total = write_training_set(out, tmp_path / "train.jsonl")
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").open()]
    assert total == 5 and kept == len(train) and all(set(r) == {"messages"} for r in train)
    assert rows[0]["messages"] in [r["messages"] for r in train] and rows[1]["messages"] not in [
        r["messages"] for r in train
    ]


def test_scoring():
    assert gsm8k_correct("She has 3 + 4 = 7 apples.\nThe answer is 1,072.", "1072")
    assert not gsm8k_correct("The answer is 1,073.", "1072") and not gsm8k_correct("no number", "5")
    problem = humaneval()[2]["problem"]
    body = problem["canonical_solution"]
    assert humaneval_correct(body, problem)  # a body completes the prompt
    assert humaneval_correct(f"Sure:\n```python\n{problem['prompt']}{body}```\nDone.", problem)  # a whole function
    assert not humaneval_correct("```python\ndef truncate_number(number):\n    return 0.0\n```", problem)
    assert not humaneval_correct("```python\nwhile True:\n    pass\n```", problem, timeout=1.0)  # time limit


def test_tau_table_on_a_trained_toy(trained_toy):
    model, tok = trained_toy
    from hf_mars.tools.checkpoints.toy import counting_dataset

    rows = [
        {"prompt": ex["messages"][0]["content"], "task": "gsm8k", "answer": ex["messages"][1]["content"].split()[-1]}
        for ex in counting_dataset(8, seed=77)
    ]
    table = tau_table(model, tok, rows, taus=(1.0, 0.5), base_model=model, batch_size=4, max_new_tokens=40)
    base, exact, fast = table
    assert exact["same_as_tau1"] == 100.0 and exact["tokens_per_forward"] == 1.0
    assert exact["gsm8k"] == base["gsm8k"]  # τ = 1 is the model itself
    assert fast["tokens_per_forward"] > 1.3 and 0 <= fast["same_as_tau1"] <= 100
    text = format_tau_table(table)
    assert "| MARS τ=0.5 |" in text and "GSM8K" in text and "HumanEval" not in text
    assert torch.is_grad_enabled()  # decoding ran under inference_mode without leaking it


def test_distill_stops_at_its_time_budget_and_reports(tmp_path):
    tok, model = make_tokenizer(), make_model("llama")
    prompts = [{"prompt": f"count {i} {i + 1}", "source": "toy"} for i in range(6)]
    out = tmp_path / "distilled.jsonl"
    stats = distill(model, tok, prompts, out, max_new_tokens=4, batch_size=2, time_budget=0)
    assert stats["answered"] == 0 and stats["stopped"] == "time budget" and out.read_text() == ""
    stats = distill(model, tok, prompts, out, max_new_tokens=4, batch_size=2)
    rows = [json.loads(line) for line in out.open()]
    assert stats["answered"] == len(rows) == 6 and stats["stopped"] == "done"
    assert stats["finished"] == sum(r["finished"] for r in rows)
    assert stats["finished"] * 1 <= stats["new_tokens"] <= 6 * 4


@pytest.fixture
def toy_base(tmp_path):
    """A tiny random Llama saved as a base model. A random model seldom writes EOS, so most of its tokens end an
    answer here (generation_config.eos_token_id): self-distillation then has finished answers to keep."""
    tok = make_tokenizer()
    model = make_model("llama", tie_word_embeddings=True, max_position_embeddings=2048)
    model.generation_config.eos_token_id = [tok.eos_token_id, *range(130, 272)]
    model.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def recipe_cli(base, out, *extra):
    from hf_mars.cli import main

    main(
        ["recipe", "--output-dir", str(out), "--model", str(base), "--prompts", "12", "--device", "cpu"]
        + ["--sources", "gym:basic_arithmetic", "gym:chain_sum", "mbpp", "--dtype", "float32"]
        + ["--max-new-tokens", "8", "--batch-size", "4", "--max-length", "256", "--train-args", "--max_steps 2"]
        + ["--eval-gsm8k", "2", "--eval-humaneval", "0", "--eval-taus", "1.0", "0.5", "--eval-batch-size", "2"]
        + list(extra)
    )


def test_recipe_runs_every_stage_then_skips_what_is_done(toy_base, tmp_path, capsys):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hf_mars.tools.checkpoints.loading import load_checkpoint

    out = tmp_path / "run"
    recipe_cli(toy_base, out)
    report = json.loads((out / "prompts.json").read_text())
    assert sum(report["counts"].values()) == 12 == len((out / "prompts.jsonl").read_text().splitlines())
    distilled = json.loads((out / "distill.json").read_text())
    assert distilled["answered"] == 12 and distilled["kept"] == len((out / "train.jsonl").read_text().splitlines())
    assert all(v.dtype == torch.float16 for v in load_file(out / "delta" / "adapter_model.safetensors").values())
    model, _ = load_checkpoint(str(out / "checkpoint"))
    plain = AutoModelForCausalLM.from_pretrained(toy_base)
    assert model.config.mars_block_size == 4 and type(model).__name__.startswith("MARS")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(model.state_dict()[q], plain.state_dict()[q])  # the trained LoRA is merged in
    table = json.loads((out / "eval-lora" / "eval.json").read_text())["rows"]
    assert [row["tau"] for row in table] == [None, 1.0, 0.5]  # the base model first
    assert table[1]["same_as_tau1"] == 100.0

    files = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    recipe_cli(toy_base, out)  # a second run finds every stage done
    printed = capsys.readouterr().out
    assert all(f"[{stage}] done already" in printed for stage in ("prompts", "distill", "train", "export", "eval"))
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == files

    recipe_cli(toy_base, out, "--full-finetune")  # the same data, a full fine-tune beside the LoRA run
    printed = capsys.readouterr().out
    assert "[prompts] done already" in printed and "[distill] done already" in printed
    full, _ = load_checkpoint(str(out / "mars-full"))
    assert not torch.equal(full.state_dict()[q], plain.state_dict()[q])
    assert (out / "eval-full" / "eval.json").is_file()


class VirtualTime:
    """`time.monotonic` moved on by `generate_s` at each generate() call and by `step_s` at each training step: a time
    budget then stops a stage after a known number of batches or steps, whatever this machine's speed. Counts the
    training steps run."""

    def __init__(self, monkeypatch):
        self.offset, self.generate_s, self.step_s, self.steps = 0.0, 0.0, 0.0, 0
        real_clock, real_generate, real_step = time.monotonic, GenerationMixin.generate, MARSTrainer.training_step

        def generate(model, *args, **kwargs):
            self.offset += self.generate_s
            return real_generate(model, *args, **kwargs)

        def training_step(trainer, *args, **kwargs):
            self.offset += self.step_s
            self.steps += 1
            return real_step(trainer, *args, **kwargs)

        monkeypatch.setattr(time, "monotonic", lambda: real_clock() + self.offset)
        monkeypatch.setattr(GenerationMixin, "generate", generate)
        monkeypatch.setattr(MARSTrainer, "training_step", training_step)


def stages(out) -> dict:
    return json.loads((out / "recipe.json").read_text())["stages"]


def test_recipe_stopped_by_its_time_budget_continues_in_a_copy_elsewhere(toy_base, tmp_path, monkeypatch, capsys):
    """Distillation stops between batches and training at a step with a checkpoint; a copy of the folder, with the
    base model moved too, continues each where it stopped and ends with the weights of an uninterrupted run."""
    clock = VirtualTime(monkeypatch)
    run = ["--distill-batch-size", "4", "--train-args", "--max_steps 3"]
    first, second, third = tmp_path / "first", tmp_path / "second", tmp_path / "third"

    clock.generate_s = 100  # 12 prompts in 3 batches: the budget stops distillation after two
    recipe_cli(toy_base, first, *run, "--time-budget", "150")
    later = {"train": "not started", "export": "not started", "eval": "not started"}
    assert stages(first) == {"prompts": "done", "distill": "stopped (time budget)", **later}
    assert len((first / "distilled.jsonl").read_text().splitlines()) == 8 and not (first / "distill.json").exists()

    shutil.copytree(first, second)
    capsys.readouterr()
    clock.step_s = 100  # the last batch, then one training step spends the budget
    recipe_cli(toy_base, second, *run, "--time-budget", "150")
    assert stages(second) == dict(later, prompts="done", distill="done", train="stopped (time budget)")
    assert "not done yet: train, export, eval" in capsys.readouterr().out
    assert json.loads((second / "distill.json").read_text())["total"] == 12
    assert [p.name for p in (second / "mars-lora").glob("checkpoint-*")] == ["checkpoint-1"]
    assert {"optimizer.pt", "scheduler.pt"} <= {p.name for p in (second / "mars-lora" / "checkpoint-1").iterdir()}
    assert clock.steps == 1 and not (second / "mars-lora" / "mars.json").exists()

    shutil.copytree(second, third)
    (tmp_path / "another machine").mkdir()
    base = toy_base.rename(tmp_path / "another machine" / toy_base.name)
    recipe_cli(base, third, *run)  # no budget: to the end
    assert set(stages(third).values()) == {"done"} and (third / "eval-lora" / "eval.json").is_file()
    assert (
        clock.steps == 3 and json.loads((third / "mars-lora" / "trainer_state.json").read_text())["global_step"] == 3
    )
    for path in third.rglob("*"):
        if path.suffix in (".json", ".jsonl", ".md"):
            text = path.read_text()
            assert str(first) not in text and str(second) not in text, path  # the folder moved: nothing names it

    whole = tmp_path / "whole"  # the same data, trained without a stop
    whole.mkdir()
    for name in ("prompts.jsonl", "prompts.json", "distilled.jsonl", "train.jsonl", "distill.json"):
        shutil.copy(third / name, whole / name)
    recipe_cli(base, whole, *run, "--eval-gsm8k", "0")
    assert clock.steps == 6
    resumed, uninterrupted = (load_file(out / "mars-lora" / "adapter_model.safetensors") for out in (third, whole))
    assert resumed.keys() == uninterrupted.keys()
    for name, weight in resumed.items():
        torch.testing.assert_close(weight, uninterrupted[name], msg=name)


def test_settings_come_from_one_dataclass_a_yaml_config_and_the_command_line(tmp_path):
    config = tmp_path / "recipe.yaml"
    config.write_text("output_dir: out\nprompts: 7\nmax_new_tokens: 9\neval_taus: [1.0, 0.5]\n")
    argv = ["--config", str(config), "--prompts", "8", "--max_length", "99", "--no-eval-base", "--full-finetune"]
    settings = parse_settings(Recipe, argv + ["--train-args", "--max_steps 3 --learning_rate 1e-3"], "recipe", "")
    assert (settings.prompts, settings.max_new_tokens, settings.max_length) == (8, 9, 99)  # the command line wins
    assert settings.eval_taus == [1.0, 0.5] and not settings.eval_base and settings.full_finetune
    assert settings.batch_size == Recipe.__dataclass_fields__["batch_size"].default
    assert parse_settings(Recipe, ["--output-dir", "a"], "recipe", "").output_dir == "a"
    step1 = parse_settings(DistillSettings, ["--references"], "distill", "")  # other defaults, the same fields
    assert (step1.prompts, step1.max_new_tokens, step1.distill_batch_size) == (1000, 192, 40)
    assert step1.references and step1.output_dir == "outputs/recipe" and step1.seed == settings.seed

    script, training, model = recipe.train_settings(settings, "base", "cpu")  # --train-args over the recipe's values
    assert (training.max_steps, training.learning_rate, training.max_length) == (3, 1e-3, 99)
    assert training.output_dir == str(settings.train_dir) and training.mars_block_size == settings.block_size
    assert training.use_cpu and not model.use_peft and script.dataset_name == str(settings.out / "train.jsonl")
    settings.full_finetune, settings.train_args = False, ""
    _, training, model = recipe.train_settings(settings, "base", "cpu")
    assert training.learning_rate == 4e-4 and model.use_peft and model.lora_r == 32
    assert training.resume_from_checkpoint is None


def test_recipe_and_distill_refuse_bad_input_in_one_line(toy_base, tmp_path):
    from hf_mars.cli import main

    for argv, message in [
        (["recipe", "--output-dir", str(tmp_path / "a"), "--prompts", "0"], "--prompts must be at least 1"),
        (["distill", "--output-dir", str(tmp_path / "b"), "--sources", "gym:gsm_symbolic"], "GSM8K test"),
        (["distill", "--output-dir", str(tmp_path / "c"), "--prompts", "600", "--sources", "mbpp"], "supply 499"),
        (["distill", "--output-dir", str(tmp_path / "d"), "--model", str(tmp_path)], "no config.json"),
    ]:
        with pytest.raises(SystemExit) as err:
            main(argv)
        assert message in str(err.value) and "\n" not in str(err.value)
    recipe_cli(toy_base, tmp_path / "e", "--eval-gsm8k", "0")
    with pytest.raises(SystemExit, match="other settings .*prompts 12 -> 13"):
        recipe_cli(toy_base, tmp_path / "e", "--prompts", "13")


SETTINGS = {"recipe": Recipe, "distill": DistillSettings}


def test_the_example_scripts_use_options_the_cli_has():
    """Every `hf-mars` line of examples/*.sh (but `train`, TRL's parser) parses: no stale option after a change."""
    import re
    import shlex
    from pathlib import Path

    from hf_mars.cli import build_parser

    commands = []
    for script in sorted((Path(__file__).parents[2] / "examples").glob("*.sh")):
        text = re.sub(r"\\\n\s*", " ", script.read_text())
        commands += [line.strip() for line in text.splitlines() if line.strip().startswith("hf-mars ")]
    assert any(c.startswith("hf-mars distill") for c in commands) and any("hf-mars recipe" in c for c in commands)
    for command in commands:
        argv = shlex.split(command.replace('"$@"', "").split(" #")[0])[1:]
        if argv[0] != "train":
            args = build_parser().parse_args([arg.replace("$OUT", "out") for arg in argv])
        if argv[0] in SETTINGS:  # TRL's parser reads these commands' options
            parse_settings(SETTINGS[argv[0]], args.argv, argv[0], "")
