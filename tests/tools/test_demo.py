"""`hf-mars demo` end to end, shortened: MARSTrainer trains, the checkpoint saves, MARS decodes it."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from hf_mars.tools.checkpoints.demo import run_demo


def test_demo_trains_saves_and_decodes(tmp_path, capsys):
    run_demo(steps=30, block_size=4, output_dir=tmp_path / "demo", tau=0.9, eval_prompts=4, timing_prompts=1)
    printed = capsys.readouterr().out
    table = [line.split() for line in printed.splitlines() if line.strip().startswith(("1.0 ", "0.9 ", "0.7 "))]
    assert [row[0] for row in table] == ["1.0", "0.9", "0.7"]
    assert float(table[0][1]) == 1.0 and table[0][3] == "100%"  # τ = 1: one token per pass, the reference
    assert "plain generate()" in printed and "MARS τ=0.9" in printed
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "demo", trust_remote_code=True)
    assert model.config.mars_block_size == 4
    out = model.generate(
        input_ids=torch.tensor([[1, 80, 81]]), mars_tau=0.9, max_new_tokens=5, return_dict_in_generate=True
    )
    assert out.mars_stats.forward_passes >= 1
