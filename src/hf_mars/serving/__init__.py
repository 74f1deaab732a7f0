"""`hf-mars serve`: an OpenAI-compatible server for MARS checkpoints, on transformers serve's serving package.

`server.py` adapts transformers serve (loading, request fields, usage); `batcher.py` decodes concurrent requests in
one `generate()` call. See docs/serving.md.
"""
