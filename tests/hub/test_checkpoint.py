"""Checkpoints: self-contained remote code, plain-base loading, MARS defaults that persist, authors' conversion."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import make_model, make_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_mars
from hf_mars.decoding import REMOTE_DIR, REMOTE_FILES


def saved_mars(tmp_path, family="qwen2", tau=0.7, block_size=4):
    tok = make_tokenizer()
    model = make_model(family)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    hf_mars.to_mars(model, tok, block_size=block_size, tau=tau)
    path = tmp_path / "ckpt"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok, path


def run_without_hf_mars(code: str) -> str:
    """Run `code` in a fresh interpreter in which `import hf_mars` fails, as on a machine without the package."""
    prelude = "import sys; sys.modules['hf_mars'] = None\n"
    result = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_remote_files_name_every_decoding_module():
    """`REMOTE_FILES` is the one list of what ships in a checkpoint: every module of hf_mars/decoding, no other."""
    modules = {p.name for p in REMOTE_DIR.glob("*.py")} - {"__init__.py"}
    assert set(REMOTE_FILES) == modules


def test_the_model_class_file_imports_every_sibling_by_name():
    """transformers before 5.10 copies into its modules cache only what the class's own file imports, not what those
    import in turn: a sibling that `modeling.py` does not name is missing when such a release loads a checkpoint."""
    text = (REMOTE_DIR / "modeling.py").read_text()
    imported = set(re.findall(r"^from \.(\w+) import", text, flags=re.MULTILINE))
    assert imported == {name.removesuffix(".py") for name in REMOTE_FILES} - {"modeling"}


def test_saved_folder_holds_the_very_decoding_modules(tmp_path):
    _, _, path = saved_mars(tmp_path)
    assert {p.name for p in path.glob("*.py")} == set(REMOTE_FILES)  # save_pretrained follows the imports to all
    for name in REMOTE_FILES:
        assert (path / name).read_text() == (REMOTE_DIR / name).read_text()  # one source of truth, copied verbatim
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["auto_map"] == {"AutoModelForCausalLM": "modeling.MARSQwen2ForCausalLM"}
    assert config["mars_block_size"] == 4 and config["mars_mask_token_id"] == 259
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["mars_tau"] == 0.7 and gen["mars_block_size"] == 4 and gen["mars_confidence"] == "probability"
    # The remote code imports nothing of hf_mars: only the standard library, torch, transformers and its siblings.
    siblings = {name.removesuffix(".py") for name in REMOTE_FILES}
    for name in REMOTE_FILES:
        source = (path / name).read_text()
        imports = [line.split()[1] for line in source.splitlines() if line.startswith(("import ", "from "))]
        assert imports and all(
            module.split(".")[0] in sys.stdlib_module_names | {"torch", "transformers"}
            or (module.startswith(".") and module[1:] in siblings)
            for module in imports
        ), (name, imports)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_load_with_remote_code_without_hf_mars_and_generate(tmp_path, family):
    model, tok, path = saved_mars(tmp_path, family)
    enc = tok(["hello world", "a b"], return_tensors="pt", padding=True)
    expected = model.generate(**enc, mars_tau=0.7, max_new_tokens=20, return_dict_in_generate=True)
    out = run_without_hf_mars(
        f"""
        import json, torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tok = AutoTokenizer.from_pretrained({str(path)!r})
        model = AutoModelForCausalLM.from_pretrained({str(path)!r}, trust_remote_code=True)
        enc = tok(["hello world", "a b"], return_tensors="pt", padding=True)
        explicit = model.generate(**enc, mars_tau=0.7, max_new_tokens=20, return_dict_in_generate=True)
        default = model.generate(**enc, max_new_tokens=20)  # mars_tau=0.7 from the saved generation config
        print(json.dumps(dict(cls=type(model).__name__, explicit=explicit.sequences.tolist(), default=default.tolist(),
                              passes=explicit.mars_stats.forward_passes)))
        """
    )
    result = json.loads(out.strip().splitlines()[-1])
    assert result["cls"].startswith("MARS")
    assert result["explicit"] == expected.sequences.tolist() == result["default"]
    assert result["passes"] == expected.mars_stats.forward_passes < 20


def test_remote_code_times_nothing_and_reads_the_costs_hf_mars_timed(tmp_path, monkeypatch):
    """A checkpoint's code carries no timing: without hf_mars, lossless "auto" on an unmeasured machine chooses from
    what is known of its kind of device (here: no tree pays a CPU in float32 at 1.9 tokens per forward) and says how
    to measure; once hf_mars has timed this machine's pass costs, the same code reads them and runs the tree they
    favour. The output is greedy `generate()`'s either way."""
    from transformers import GenerationConfig

    from hf_mars.tools.measure import passes

    model, tok, path = saved_mars(tmp_path, "llama", block_size=2)
    for config in (model.generation_config, GenerationConfig.from_pretrained(path)):
        config.mars_lossless, config.mars_acceptance, config.mars_tau = "auto", {"2x1": 1.9}, None
    config.save_pretrained(path)
    monkeypatch.setenv("HF_MARS_CACHE", str(tmp_path / "cache"))
    code = f"""
        import json, torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationMixin
        torch.set_num_threads({torch.get_num_threads()})  # the cost table's key names the thread count
        tok = AutoTokenizer.from_pretrained({str(path)!r})
        model = AutoModelForCausalLM.from_pretrained({str(path)!r}, trust_remote_code=True)
        enc = tok(["hello world"], return_tensors="pt")
        out = model.generate(**enc, mars_verify=True, max_new_tokens=12)
        greedy = GenerationMixin.generate(model, **enc, do_sample=False, max_new_tokens=12)
        tree = model.mars_settings(mars_verify=True)["mars_block_size"]
        print(json.dumps(dict(tree=tree, greedy=torch.equal(out, greedy))))
        """

    def run():
        prelude = "import sys; sys.modules['hf_mars'] = None\n"
        done = subprocess.run(
            [sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr

    unmeasured, said = run()
    assert unmeasured == {"tree": 1, "greedy": True} and "hf_mars.measure(model, batch_sizes=[1])" in said
    monkeypatch.setattr(passes, "measure_pass_costs", lambda m, b, widths, **_: {w: 0.01 for w in widths})  # free
    monkeypatch.setattr(passes, "measure_overheads", lambda *a, **k: dict(plain_overhead=0.0, mars_overhead=0.0))
    assert hf_mars.measure(model, [1], mars_verify=True)[1]["mars_block_size"] == 2
    measured, said = run()
    assert measured == {"tree": 2, "greedy": True} and "chose from what is known" not in said


def test_loads_as_plain_base_model_without_remote_code(tmp_path):
    model, tok, path = saved_mars(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(path)
    assert type(plain).__name__ == "Qwen2ForCausalLM"
    enc = tok(["hello world"], return_tensors="pt")
    ref = make_model("qwen2")
    ref.load_state_dict(plain.state_dict())
    greedy = dict(do_sample=False, max_new_tokens=12)
    assert torch.equal(plain.generate(**enc, **greedy), ref.generate(**enc, **greedy))
    # ...and the MARS model at τ = 1 decodes exactly as that plain model does
    assert torch.equal(model.generate(**enc, mars_tau=1.0, max_new_tokens=12), plain.generate(**enc, **greedy))


def test_resaving_a_remote_code_model_keeps_it_self_contained(tmp_path):
    _, tok, path = saved_mars(tmp_path)
    again = tmp_path / "again"
    run_without_hf_mars(
        f"""
        from transformers import AutoModelForCausalLM
        AutoModelForCausalLM.from_pretrained({str(path)!r}, trust_remote_code=True).save_pretrained({str(again)!r})
        """
    )
    assert {p.name for p in again.glob("*.py")} == set(REMOTE_FILES)
    assert (
        json.loads((again / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"]
        == "modeling.MARSQwen2ForCausalLM"
    )


def test_mask_token_takes_a_spare_row_or_resizes(caplog):
    tok = make_tokenizer()
    spare = hf_mars.to_mars(make_model("qwen2", vocab_size=272), tok)
    assert spare.get_input_embeddings().weight.shape[0] == 272
    assert tok.convert_tokens_to_ids(hf_mars.MASK_TOKEN) == spare.config.mars_mask_token_id == 259
    tok = make_tokenizer()
    full = make_model("qwen2", vocab_size=259)
    with caplog.at_level("WARNING"):
        hf_mars.to_mars(full, tok)
    assert full.get_input_embeddings().weight.shape[0] == 260 and "resizing" in caplog.text
    again = hf_mars.to_mars(spare, tok)  # idempotent: the token is not added twice
    assert again.config.mars_mask_token_id == 259 and type(again).__mro__.count(hf_mars.MARSGenerationMixin) == 1


def authors_checkpoint(tmp_path) -> Path:
    """A folder shaped like the authors' releases: model_type a2d-qwen2, Qwen2 weights, <|mask|> in the tokenizer."""
    tok = make_tokenizer()
    tok.add_special_tokens({"extra_special_tokens": ["<|mask|>"]}, replace_extra_special_tokens=False)
    model = make_model("qwen2")
    src = tmp_path / "authors"
    model.save_pretrained(src)
    tok.save_pretrained(src)
    config = json.loads((src / "config.json").read_text())
    config.update(model_type="a2d-qwen2", architectures=["A2DQwen2LMHeadModel"], auto_map={"AutoModel": "x.Y"})
    (src / "config.json").write_text(json.dumps(config))
    return src


def test_convert_authors_checkpoint(tmp_path):
    src = authors_checkpoint(tmp_path)
    dst = hf_mars.convert_checkpoint(src, tmp_path / "converted", block_size=8, tau=0.9)
    config = json.loads((dst / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["mars_block_size"] == 8
    assert config["auto_map"] == {"AutoModelForCausalLM": "modeling.MARSQwen2ForCausalLM"}
    model = AutoModelForCausalLM.from_pretrained(dst, trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(dst)
    ref = make_model("qwen2")
    enc = tok(["hello"], return_tensors="pt")
    assert torch.equal(
        model.generate(**enc, mars_tau=1.0, max_new_tokens=8), ref.generate(**enc, do_sample=False, max_new_tokens=8)
    )
    assert model.config.mars_mask_token_id == tok.convert_tokens_to_ids("<|mask|>")


def test_convert_refuses_a_checkpoint_without_mask_token(tmp_path):
    model, tok = make_model("llama"), make_tokenizer()
    model.save_pretrained(tmp_path / "llama")
    tok.save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="not a MARS"):
        hf_mars.convert_checkpoint(tmp_path / "llama", tmp_path / "out")
