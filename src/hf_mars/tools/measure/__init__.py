"""Measurement: this machine's pass costs, which `"auto"` settings read (`passes`: `hf_mars.measure`), the dtype to
decode in (`dtypes`), the speed table (`bench`), the server under load (`serve_bench`), the CPU proxy of a GPU
(`hostbound`), mask costs (`calibrate`), lossless trees (`tuning`, `trees`), decoding as they run it (`decode`), and
their tables and plots."""
