"""Training in several processes. Two CPU processes (DDP over gloo), launched as docs/training.md tells users to
(`accelerate launch --config_file examples/accelerate/multi_cpu.yaml ... --use_cpu`), learn what one process learns
on the same global batches and save a checkpoint that decodes like one process's; the shipped accelerate configs
are what `accelerate launch` reads; a launch that would train unsynchronised copies is refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import make_model, make_tokenizer, run_launched, toy_prompts
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_mars
from hf_mars.tools.checkpoints.toy import counting_dataset
from hf_mars.training.train import check_processes

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_mars.py"
CONFIGS = ROOT / "examples" / "accelerate"
ROWS, GLOBAL_BATCH, STEPS = 40, 4, 3
TIMEOUT = 300  # seconds per training run; each takes 7-10 s on 2 cores (start, import torch, 3 steps)


def train(tmp_path, name, processes, cli=False):
    """Train STEPS steps on global batches of GLOBAL_BATCH rows, as `processes` processes; returns the output folder.

    Same seed, same data, no dropout (the toy model has none), no gradient accumulation: only the split of each
    global batch differs. The Trainer's RandomSampler becomes accelerate's SeedableRandomSampler, seeded alike in every
    process and in a single one, so there is one permutation of the rows; it is cut into per-process batches of
    GLOBAL_BATCH // processes rows, and batch i goes to process i % processes (BatchSamplerShard, split_batches
    off). Step k therefore trains on the same GLOBAL_BATCH rows either way (40 rows: no uneven last batch).
    """
    base, data, out = tmp_path / "base", tmp_path / "train.jsonl", tmp_path / name
    if not base.exists():
        make_model("llama").save_pretrained(base)
        make_tokenizer().save_pretrained(base)
        data.write_text("".join(json.dumps(ex) + "\n" for ex in counting_dataset(ROWS)))
    args = [
        *("--model_name_or_path", str(base), "--dataset_name", str(data), "--output_dir", str(out)),
        *("--per_device_train_batch_size", str(GLOBAL_BATCH // processes), "--max_steps", str(STEPS)),
        # 1e-3, not TRL's 2e-5: the weights move enough in 3 steps that unsynchronised processes would log other losses
        *("--learning_rate", "1e-3", "--mars_block_size", "4", "--logging_steps", "1"),
        *("--save_strategy", "steps", "--save_steps", str(STEPS)),  # checkpoint-3/trainer_state.json: exact losses
        *("--use_cpu", "--bf16", "false", "--report_to", "none", "--activation_checkpointing", "false"),
    ]
    entry = ["-m", "hf_mars.cli", "train"] if cli else [str(SCRIPT)]
    launcher = []
    if processes > 1:
        assert processes == 2  # multi_cpu.yaml's num_processes
        launcher = ["-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "multi_cpu.yaml")]
    returncode, stderr = run_launched([sys.executable, *launcher, *entry, *args], TIMEOUT)
    assert returncode == 0, stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("multiprocess")
    return {
        "one": train(tmp_path, "one", processes=1),
        "two": train(tmp_path, "two", processes=2),  # examples/train_mars.py under the launcher
        "two-cli": train(tmp_path, "two-cli", processes=2, cli=True),  # hf-mars train under the launcher
    }


def logged(out):
    state = json.loads((out / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return state, [entry for entry in state["log_history"] if "loss" in entry]


@pytest.mark.slow  # three training subprocesses, two of them two-process runs: about 30 s on 2 cores
def test_two_processes_train_as_one_does(runs):
    one_state, one = logged(runs["one"])
    assert one_state["epoch"] == pytest.approx(STEPS * GLOBAL_BATCH / ROWS)
    for name in ("two", "two-cli"):
        state, two = logged(runs[name])
        # Two processes that each trained alone would have seen half the rows per step: epoch 0.15, not 0.3
        assert state["epoch"] == one_state["epoch"] and [e["step"] for e in two] == list(range(1, STEPS + 1))
        for a, b in zip(one, two):
            for key in ("loss", "clean_loss", "mask_loss", "grad_norm"):
                # Not bit-equal: each process pads its 2 rows to their own longest (other matmul shapes, other
                # reduction orders in the kernels), and DDP's all-reduce averages two 2-row gradients where one
                # process sums 4 rows, each a few float32 ulps (1.2e-7) apart. Measured here: at most 1e-7 relative
                # (12.956107 vs 12.956108), weights 5e-7 apart after 3 steps. 1e-5 leaves 100x room; a real
                # difference (other rows in a step, a gradient not averaged, unsynchronised copies) moves these by
                # over 1e-3.
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (name, a["step"], key)


@pytest.mark.slow  # shares the training runs above
def test_two_process_checkpoint_decodes_like_the_one_process_one(runs):
    one, two = (AutoModelForCausalLM.from_pretrained(runs[n], trust_remote_code=True) for n in ("one", "two"))
    assert two.config.mars_block_size == 4 and type(two).__name__ == type(one).__name__
    weights_one, weights_two = one.state_dict(), two.state_dict()
    assert weights_one.keys() == weights_two.keys()
    assert all(torch.allclose(weights_one[k], weights_two[k], rtol=0, atol=1e-5) for k in weights_one)

    tok = AutoTokenizer.from_pretrained(runs["two"], padding_side="left")
    inputs = toy_prompts(tok, n=4)
    settings = dict(max_new_tokens=12, do_sample=False)
    plain = {}
    for name, model in (("one", one), ("two", two)):
        plain[name] = model.generate(**inputs, **settings)
        # tau = 1 is the autoregressive model; lossless mode is greedy generate()'s text exactly in float32
        assert torch.equal(model.generate(**inputs, mars_tau=1.0, **settings), plain[name]), name
        assert torch.equal(model.generate(**inputs, mars_verify=True, **settings), plain[name]), name

    # The weights differ by float32 rounding only: the logits agree to 1e-4 on the same tokens (measured: 7e-6, on
    # logits up to 6.5), and where every top-2 margin exceeds twice the largest difference (here the smallest margin
    # is 1.3e-3, 180x the difference) the two models' greedy tokens must be the same
    attention = torch.ones_like(plain["one"]).masked_fill(plain["one"] == tok.pad_token_id, 0)
    with torch.no_grad():
        logits = [m(input_ids=plain["one"], attention_mask=attention).logits for m in (one, two)]
    kept = attention.bool()
    difference = (logits[0][kept] - logits[1][kept]).abs().max()
    assert difference < 1e-4
    top2 = logits[0][kept].topk(2).values
    if (top2[:, 0] - top2[:, 1]).min() > 2 * difference:
        assert torch.equal(plain["two"], plain["one"])


def test_a_launch_whose_processes_would_train_alone_is_refused(monkeypatch):
    # torchrun on a machine without a GPU, the script run without --use_cpu: WORLD_SIZE 2, but accelerate sets up no
    # process group (world size 1), and each process would train alone on every row
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--use_cpu"):
        check_processes(SimpleNamespace(world_size=1))
    check_processes(SimpleNamespace(world_size=2))
    monkeypatch.delenv("WORLD_SIZE")
    check_processes(SimpleNamespace(world_size=1))


# What each shipped config must make `accelerate launch` do: (launcher flag, processes, mixed precision)
LAUNCHES = {
    "multi_cpu.yaml": ("multi_gpu", 2, "no"),  # torchrun: the only local multi-process launcher (see the file)
    "ddp.yaml": ("multi_gpu", 8, "bf16"),
    "fsdp.yaml": ("use_fsdp", 8, "bf16"),
    "deepspeed_zero2.yaml": ("use_deepspeed", 8, "bf16"),
}


def launch_args(name):
    """The file read as `accelerate launch --config_file` reads it (accelerate's own config class and checks)."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    path = str(CONFIGS / name)
    config = load_config_from_file(path)  # accelerate's ClusterConfig: refuses unknown top-level keys
    parser = launch_command_parser()
    # The nested keys become launcher arguments; a misspelt one would be dropped silently
    nested = {**(config.fsdp_config or {}), **(config.deepspeed_config or {})}
    assert set(nested) <= {action.dest for action in parser._actions}, name
    args, _, mixed_precision_from_config = _validate_launch_command(parser.parse_args(["--config_file", path, "x.py"]))
    return config, args, mixed_precision_from_config


@pytest.mark.parametrize("name", LAUNCHES)
def test_accelerate_config_launches_what_it_says(name):
    flag, processes, mixed_precision = LAUNCHES[name]
    _, args, _ = launch_args(name)
    flags = ("multi_gpu", "use_fsdp", "use_deepspeed", "tpu", "cpu")
    assert [f for f in flags if getattr(args, f)] == [flag]
    assert (args.num_processes, args.num_machines, args.mixed_precision) == (processes, 1, mixed_precision)
    assert sorted(path.name for path in CONFIGS.glob("*.yaml")) == sorted(LAUNCHES)


def test_fsdp_config_fully_shards_each_decoder_layer(monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    _, args, _ = launch_args("fsdp.yaml")
    env = prepare_multi_gpu_env(args)  # what the launched processes receive
    for key, value in env.items():
        if key.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()  # built from that environment, as each process builds it
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True  # FSDP2's full shard
    assert "FULL_STATE_DICT" in str(plugin.state_dict_type)  # the final save is a whole, loadable checkpoint
    model = hf_mars.to_mars(make_model("qwen2"), make_tokenizer(), block_size=4)
    plugin.set_auto_wrap_policy(model)
    assert plugin.transformer_cls_names_to_wrap == ["Qwen2DecoderLayer"]  # from the model, not named in the file


def test_deepspeed_config_is_zero2_in_bf16(monkeypatch):
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    config, args, mixed_precision_from_config = launch_args("deepspeed_zero2.yaml")
    # As launch_command does before it calls the DeepSpeed launcher
    fields = list(config.deepspeed_config) + (["mixed_precision"] if mixed_precision_from_config else [])
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    _, env = prepare_deepspeed_cmd_env(args)
    for key, value in env.items():
        if key.startswith("ACCELERATE_"):
            monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()  # built from that environment; needs no deepspeed package
    plugin.set_mixed_precision(env["ACCELERATE_MIXED_PRECISION"])
    zero = plugin.deepspeed_config["zero_optimization"]
    assert zero["stage"] == 2 and zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "none"
    assert plugin.deepspeed_config["bf16"]["enabled"] is True
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == "auto"  # the script's arguments decide
