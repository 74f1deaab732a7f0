"""Evaluation: the held-out sets (`eval_sets`), scoring answers (`evals`) and the quality-speed frontier
(`frontier`)."""
