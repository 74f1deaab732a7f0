"""`hf-mars serve`: an OpenAI-compatible server for MARS checkpoints, on transformers serve's serving package.

`server.py` adapts transformers serve (loading, request fields, usage); `engine.py` decodes every request in one
running MARS session that requests join between passes and leave when they stop. See docs/serving.md.
"""
