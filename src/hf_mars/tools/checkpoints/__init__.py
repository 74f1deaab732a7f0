"""Checkpoint assets: loading checkpoints and chat prompts (`loading`), the shipped checkpoint's build (`shipped`),
and the toy models of tests and demos (`toy`, `demo`)."""
