"""Tools around MARS decoding: the shipped checkpoint, benchmarks, evaluation sets, the toy demo.

`loading` holds what the command line, these tools and the examples share (checkpoint loading, chat prompts); it and
`trees` import neither torch nor transformers, so that `hf-mars --help` stays fast.
"""
