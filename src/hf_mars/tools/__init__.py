"""Tools around MARS decoding, one subpackage per job: `measure` (benchmarks, pass costs, trees), `evaluate` (held-out
sets, the frontier), `data` (training prompts and answers), `recipe` (hf-mars recipe), `checkpoints` (loading, the
shipped checkpoint, toy models).

`checkpoints.loading` holds what the command line, these tools and the examples share (checkpoint loading, chat
prompts); it and `measure.trees` import neither torch nor transformers, so that `hf-mars --help` stays fast.
"""
