"""`hf-mars serve`: an OpenAI-compatible server for MARS checkpoints, on transformers serve's serving package.

`server.py` adapts transformers serve (loading, request fields, usage); `engine.py` decodes every request in one
runner (decoding/runner.py) of `max_batch_size` rows over a static cache of `DEFAULT_CACHE_SLOTS` slots per row, which
requests join between passes and leave when they stop. See docs/serving.md.
"""

DEFAULT_CACHE_SLOTS = 2048  # static cache slots per row: a prompt, its max_tokens and a few passes must fit
