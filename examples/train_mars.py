"""Train a MARS model, TRL-style (TRL's `sft.py` arguments plus `--mars_block_size` and `--mars_ar_weight`).

    python examples/train_mars.py --model_name_or_path M --dataset_name D --output_dir O [--use_peft] ...
    accelerate launch --config_file zero2.yaml examples/train_mars.py ...      # several GPUs

The same as `hf-mars train`; the logic and more examples are in `hf_mars/training/train.py`.
"""

from hf_mars.training.train import run

if __name__ == "__main__":
    run()
