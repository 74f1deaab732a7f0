"""`hf-mars bench --structured` on a tiny random model: every method decodes every prompt under its schema, lossless
mode's tokens are plain constrained greedy's, and the table says so."""

from __future__ import annotations

from helpers import make_model, make_tokenizer

from hf_mars import to_mars
from hf_mars.tools.measure.structured import METHODS, format_structured, run_structured


def test_the_structured_bench_counts_each_method_and_lossless_matches_plain():
    tok = make_tokenizer()
    model = to_mars(make_model(), tok, block_size=3).eval()
    cells = run_structured(model, tok, batch_sizes=[4], max_new_tokens=24, rounds=1)
    assert [c.method for c in cells] == list(METHODS)
    by_method = {c.method: c for c in cells}
    assert all(c.outputs == 32 and len(c.seconds) == 1 and c.tokens > 0 for c in cells)
    assert by_method["lossless"].same_as_plain == 32  # exact under the grammar, whatever the model
    assert by_method["plain"].row_tokens == by_method["plain"].row_passes  # one token a step
    assert by_method["lossless"].row_passes <= by_method["plain"].row_passes
    table = format_structured(cells)
    assert "| 4 | lossless | " in table and "32/32" in table
