"""What `hf-mars serve` is doing, as Prometheus metrics at `/metrics` (the convention of vLLM and TGI).

The engine's thread reports each pass, each row's new tokens and each finished request; `/metrics` renders them with
`prometheus_client` from a registry of the app's own (two apps in one process count apart). Names start with
`hf_mars_`. Rates are the scraper's business: `rate(hf_mars_passes_total[1m])` is passes per second,
`rate(hf_mars_generation_tokens_total[1m]) / rate(hf_mars_row_passes_total[1m])` tokens per forward.

Speculation is also counted under vLLM's names (`vllm:spec_decode_*`, labels `model_name` and `engine`), so that the
dashboards operators already chart from vLLM read a MARS server too: a row's pass is a draft of the positions it could
accept beyond the model's own token (τ-mode: its B-1 masks; lossless mode: the draft tree's depth), and the tokens it
kept past the first are its accepted ones.
"""

from __future__ import annotations

import math

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds; vLLM's buckets for the same quantities, cut to what a small model serves
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
POSITIONS = 16  # a pass's accepted tokens are counted by position up to this (B and lookup drafts stay below)


class ServerMetrics:
    """The server's counters, gauges and histograms, and the calls that move them."""

    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.running = Gauge("hf_mars_requests_running", "Requests decoding now", registry=registry)
        self.waiting = Gauge("hf_mars_requests_waiting", "Requests queued, not decoding yet", registry=registry)
        self.requests = Counter(
            "hf_mars_requests", "Finished requests, by how they ended", ["outcome"], registry=registry
        )
        self.passes = Counter("hf_mars_passes", "Forward passes of the running batch", registry=registry)
        self.row_passes = Counter(
            "hf_mars_row_passes", "Forward passes summed over the rows in them", registry=registry
        )
        self.tokens = Counter("hf_mars_generation_tokens", "Tokens sent to clients", registry=registry)
        self.accepted = Counter(
            "hf_mars_accepted_tokens",
            "A row's tokens from one pass, by position in that pass (0: the model's own next token; 1 on: drafts or "
            "masks that were kept): position p over position 0 is the acceptance at p",
            ["position"],
            registry=registry,
        )
        self.ttft = Histogram(
            "hf_mars_time_to_first_token_seconds", "Arrival to first token", buckets=TTFT_BUCKETS, registry=registry
        )
        self.itl = Histogram(
            "hf_mars_inter_token_latency_seconds",
            "Seconds between a row's successive tokens (a pass's tokens share the wait before it)",
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "hf_mars_e2e_request_latency_seconds", "Arrival to last token", buckets=E2E_BUCKETS, registry=registry
        )
        self.model_name = ""  # the served name, vLLM's `model_name` label (build_app sets it)
        spec, by_position = ["model_name", "engine"], ["model_name", "engine", "position"]
        self.drafts = Counter(
            "vllm:spec_decode_num_drafts", "Row passes that fed drafts or masks", spec, registry=registry
        )
        self.draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens",
            "Positions those passes could accept beyond the model's own token (B-1 masks, or the draft tree's depth)",
            spec,
            registry=registry,
        )
        self.accepted_drafts = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Tokens kept beyond the model's own token", spec, registry=registry
        )
        self.accepted_by_position = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Tokens kept at each position beyond the model's own token (0: the first draft or mask)",
            by_position,
            registry=registry,
        )
        self.tau = Gauge("hf_mars_tau", "τ of the running rows (NaN: none, or plain decoding)", registry=registry)
        self.tree = Gauge(
            "hf_mars_tree_info",
            "The running rows' decoding: 1 on the label set in use",
            ["mode", "block_size", "draft_candidates", "lookup"],
            registry=registry,
        )
        self.pressure = Gauge(
            "hf_mars_load_pressure",
            "The load the τ policy last saw, 0 (one row, nothing waiting) to 1 (a full batch, or requests waiting)",
            registry=registry,
        )
        self.tau.set(math.nan)
        self._shown: dict | None = None

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def queue(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def settings(self, settings: dict | None) -> None:
        """The running rows' resolved MARS settings (`MARSSettings.as_kwargs()`; None or {}: no rows, or plain)."""
        if settings == self._shown:  # asked after every pass; they change when the running rows do
            return
        self._shown = settings
        self.tree.clear()
        tau = (settings or {}).get("mars_tau")
        self.tau.set(math.nan if tau is None else tau() if callable(tau) else tau)  # a range's: set every pass
        if settings:
            mode = "lossless" if settings.get("mars_verify") else "tau"
            candidates = settings.get("mars_draft_candidates")
            block, lookup = settings.get("mars_block_size"), settings.get("mars_lookup")
            self.tree.labels(mode, str(block), str(candidates if mode == "lossless" else 0), str(lookup)).set(1)

    def passed(self, rows: int) -> None:
        """One pass of `rows` rows."""
        self.passes.inc()
        self.row_passes.inc(rows)

    def delivered(self, row, new: int, now: float, reach: int = 0) -> None:
        """`new` tokens of `row` (a `Request`: its `arrived` and `last_token_at` times) sent at `now`, from a pass
        that could accept `reach` tokens beyond the model's own (0: a prompt's pass, or plain decoding)."""
        if new <= 0:
            return
        self.tokens.inc(new)
        for position in range(min(new, POSITIONS)):
            self.accepted.labels(str(position)).inc()
        if reach > 0:
            labels = (self.model_name, "0")
            self.drafts.labels(*labels).inc()
            self.draft_tokens.labels(*labels).inc(reach)
            self.accepted_drafts.labels(*labels).inc(min(new - 1, reach))
            for position in range(min(new - 1, reach, POSITIONS)):
                self.accepted_by_position.labels(*labels, str(position)).inc()
        if row.last_token_at is None:  # the prompt's pass: its token has none before it
            self.ttft.observe(now - row.arrived)
        else:
            for _ in range(new):
                self.itl.observe((now - row.last_token_at) / new)
        row.last_token_at = now

    def finished(self, row, outcome: str) -> None:
        """A request is over: `outcome` is "stop" (EOS, its budget, a stop string), "cancelled" or "error"."""
        self.requests.labels(outcome).inc()
        if row.last_token_at is not None:
            self.e2e.observe(row.last_token_at - row.arrived)
