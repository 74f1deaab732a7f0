"""`hf-mars serve`: an OpenAI-compatible server for MARS checkpoints, on transformers serve's serving package.

`server.py` adapts transformers serve (loading, request fields, usage); `engine.py` decodes every request in one
MARS runner that requests join between passes and leave when they stop. See docs/serving.md.
"""

DEFAULT_CACHE_SLOTS = 2048  # static cache slots per row of the engine's runner: a request's prompt, max_tokens, a pass
