"""MARS decoding, live: a chat whose answer streams in forward pass by forward pass, a τ slider that changes the
speed of the answer being written, the tokens of each pass as one colored span, and plain autoregressive
`generate()` on the same prompt next to it, so that the speed-up is seen rather than claimed.

    MARS_MODEL=<repo id or folder> [MARS_REVISION=<commit>] python app.py [--model ...] [--revision ...]

The checkpoint brings its own decoding code (trust_remote_code): this file needs torch, transformers and gradio.
Timing this machine's pass costs, which lossless "auto" and MARS_DTYPE=auto read, is hf_mars's: `hf-mars push-space`
uploads that part of hf_mars beside this file; without it they decode as if nothing was measured. Host and port:
Gradio's own GRADIO_SERVER_NAME / GRADIO_SERVER_PORT.
"""

from __future__ import annotations

import argparse
import functools
import html
import os
import queue
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pandas as pd
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    CompileConfig,
    GenerationMixin,
    StoppingCriteria,
    TextIteratorStreamer,
)

DEFAULT_MODEL = None  # the project's published checkpoint, once there is one; until then `hf-mars demo`'s output
DEMO_OUTPUT = "outputs/mars-demo"
MAX_INPUT_TOKENS = int(os.environ.get("MARS_MAX_INPUT_TOKENS", 1024))  # longer conversations lose their oldest turns
MAX_NEW_TOKENS = int(os.environ.get("MARS_MAX_NEW_TOKENS", 512))
CONCURRENCY = int(os.environ.get("MARS_CONCURRENCY", 2))  # generations at once; the model is shared, read-only
# MARS_DTYPE: auto (default): where lossless decoding is expected fastest here; float32: lossless text always AR's
DTYPES = ("float32", "bfloat16", "float16", "auto")
# MARS_ATTENTION: the checkpoint's (sdpa) by default; ordered: a token's bits whatever the pass holds, at a cost
ATTENTIONS = ("sdpa", "eager", "ordered")
NEAR_TIE = (
    "rounds a pass over several tokens differently from a one-token step, so where two tokens nearly tie the texts "
    "can part; MARS_ATTENTION=ordered or MARS_DTYPE=float32 keeps them identical"
)
COLORS = ["#eef0f3", "#fef08a", "#fdba74", "#fb923c", "#f87171", "#f472b6", "#c084fc", "#818cf8"]  # by tokens/pass
DECODERS = ["MARS", "AR generate()"]
UPDATE_EVERY = 0.05  # seconds between UI updates at most 20 a second; each carries every pass since the last one
CSS = ".mars-pass{border-radius:3px;padding:1px 0;border-right:1px solid rgba(0,0,0,.2);white-space:pre-wrap}"


class Session:
    """One browser session's state. `tau` is read by the running generation before every forward pass, so the slider
    (its own event, running while the answer streams) changes the speed of the answer being written."""

    def __init__(self, tau: float = 0.9):
        self.tau = tau
        self.runs: list[dict] = []  # one row per run, for the plot
        self.last: dict | None = None  # the last MARS run: its inputs and result, replayed by the AR comparison


class StopOn(StoppingCriteria):
    """Ends a generation once its event is set: the listener was cancelled or its client went away."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


def in_thread(fn, sink: queue.Queue, **kwargs) -> dict:
    """Run `fn(**kwargs)` in a thread; the returned dict gets `out` (and `seconds`, the call's own wall time, which
    the figures use: the UI's work meanwhile is not the decoder's) or `error`, and `sink` a final None on error."""
    result = {}

    def target():
        start = time.perf_counter()
        try:
            result["out"] = fn(**kwargs)
            result["seconds"] = time.perf_counter() - start
        except Exception as error:  # surfaced by the generator reading `sink`
            result["error"] = error
            sink.put(None)

    result["thread"] = threading.Thread(target=target, daemon=True)
    result["thread"].start()
    return result


def batches(sink: queue.Queue):
    """What a generation thread sent, in batches: all that is there, then a pause, until None. Fewer, larger UI
    updates leave the decoding thread the GIL: a small model decodes faster than a browser redraws."""
    while True:
        batch = [sink.get()]
        while not sink.empty():
            batch.append(sink.get_nowait())
        yield [item for item in batch if item is not None]
        if None in batch:
            return
        time.sleep(UPDATE_EVERY)


def text_of(content) -> str:
    """Chatbot message content: a string, or Gradio's list of content blocks."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def encode(tokenizer, history: list[dict], message: str) -> dict:
    """The conversation as model inputs, dropping the oldest turns past MAX_INPUT_TOKENS; a single message that is
    too long on its own is refused, never silently cut."""
    messages = [{"role": m["role"], "content": text_of(m["content"])} for m in history] + [
        {"role": "user", "content": message}
    ]
    while True:
        if tokenizer.chat_template:
            inputs = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
        else:
            inputs = tokenizer(message, return_tensors="pt")
        length = inputs["input_ids"].shape[1]
        if length <= MAX_INPUT_TOKENS:
            return dict(inputs)
        if len(messages) == 1 or not tokenizer.chat_template:
            raise gr.Error(f"Your message is {length} tokens; this demo takes at most {MAX_INPUT_TOKENS}. Shorten it.")
        messages = messages[2:] if len(messages) > 2 else messages[1:]


def spans_html(spans: list[tuple[str, int]], block_size: int) -> str:
    """Each pass's text as one span, colored by how many tokens that pass accepted."""
    legend = "".join(
        f'<span class="mars-pass" style="background:{COLORS[min(n, len(COLORS)) - 1]}">&nbsp;{n}&nbsp;</span>'
        for n in range(1, block_size + 1)
    )
    body = "".join(
        f'<span class="mars-pass" data-n="{n}" title="{n} token(s) in one forward pass" '
        f'style="background:{COLORS[min(n, len(COLORS)) - 1]}">{html.escape(text)}</span>'
        for text, n in spans
    )
    legend = f'<div class="mars-legend">MARS answer, one span per forward pass; tokens in the pass: {legend}</div>'
    return f'{legend}<div class="mars-text">{body}</div>'


def figures(name: str, tokens: int, passes: int | None, seconds: float, extra: str = "") -> str:
    """A run's figures in one line: tokens, forward passes (AR: one per token), tokens per forward, tokens/s."""
    per_forward = f" · **{tokens / passes:.2f}** tokens/forward" if passes else ""
    rate = tokens / seconds if seconds > 0 else 0.0
    passes = f"**{passes or tokens}** forward passes{per_forward}"
    return f"**{name}**: **{tokens}** tokens · {passes} · **{rate:.1f}** tokens/s{extra}"


def runs_frame(session: Session) -> pd.DataFrame:
    """The session's runs, one row each, after one empty (NaN, not drawn) row per decoder: Gradio's plot fixes its
    color legend from the first data it is given, so both decoders must be in it before any run."""
    types = {"run": int, "decoder": str, "tau": float, "tokens_per_forward": float, "tokens_per_second": float}
    legend = [
        dict(run=0, decoder=name, tau=None, tokens_per_forward=None, tokens_per_second=None) for name in DECODERS
    ]
    return pd.DataFrame(legend + session.runs, columns=list(types)).astype(types)


def lossless_tree(model) -> dict:
    """The draft tree `generate(mars_verify=True)` runs on this checkpoint, one chat at a time: its `mars_lossless`."""
    if not hasattr(model, "mars_settings"):  # a checkpoint whose remote code predates mars_lossless: B-1 masks' chain
        return dict(mars_block_size=int(model.config.mars_block_size), mars_lookup=0)
    return model.mars_settings(mars_verify=True)


def tree_description(model) -> str:
    """Lossless mode's tree in words: the checkpoint's preset, or (`mars_lossless="auto"`) the one measured fastest
    on this machine, which may be no tree at all."""
    tree = lossless_tree(model)
    if tree["mars_block_size"] == 1:
        return "no draft tree: none is expected to beat plain decoding on this machine"
    auto = getattr(model.generation_config, "mars_lossless", None) == "auto"
    whose = "the draft tree expected fastest on this machine" if auto else "the checkpoint's draft tree"
    candidates, lookup = tree.get("mars_draft_candidates", 1), tree.get("mars_lookup", 0)
    return f"{whose} (B = {tree['mars_block_size']}, {candidates} candidates, lookup {lookup})"


# The τ slider's own event, run while an answer streams: the running generation reads it before every pass. Its why
# is a comment, not a docstring: Gradio would publish a docstring as the /set_tau endpoint's description.
def set_tau(tau, session: Session):
    session.tau = float(tau)


def record_run(session: Session, decoder: str, tau: float, tokens_per_forward: float, tokens_per_second: float):
    """One point on the session's plots, for a finished run of either decoder."""
    session.runs.append(
        dict(
            run=len(session.runs) + 1,
            decoder=decoder,
            tau=tau,
            tokens_per_forward=tokens_per_forward,
            tokens_per_second=tokens_per_second,
        )
    )


# One chat turn through MARS, in three phases: prepare its settings, stream its answer pass by pass, finish it (the
# figures, the plot, what the AR comparison replays). Plain AR then runs as the next event, in two: stream, finish.


class Turn:
    """One MARS answer: what it was asked with, and what of it has been shown so far (shared by the three phases).
    A plain class, not a dataclass: the tests load this file as a module that is not in sys.modules."""

    def __init__(self, history: list[dict], inputs: dict, settings: dict, mars: dict, tree: dict, lossless, mask_cost):
        self.history = history  # the chat, the user's new message included
        self.inputs, self.prompt_tokens = inputs, inputs["input_ids"].shape[1]  # the conversation as model inputs
        self.settings = settings  # max_new_tokens and sampling, which the AR comparison replays
        self.mars = mars  # MARS's own generate() arguments: its mask cost, and its block size or verification
        self.block_size = tree["mars_block_size"]  # of the draft tree this answer runs
        self.most = max(tree["mars_block_size"] - 1, tree["mars_lookup"]) + 1  # the most tokens a pass can yield
        self.lossless, self.mask_cost = bool(lossless), float(mask_cost)
        self.taus: list[float] = []  # τ as the decoder read it, once before every forward pass
        self.ids: list[int] = []  # the answer's tokens so far
        self.passes = 0
        self.spans: list[tuple[str, int]] = []  # (text, tokens accepted) for each pass shown
        self.shown = ""  # the answer's text so far, less a character still incomplete


def sampling_settings(max_new_tokens, do_sample, temperature, top_p) -> dict:
    """generate()'s length and sampling arguments, the part of a request that the AR comparison replays."""
    sampling = (
        dict(do_sample=True, temperature=float(temperature), top_p=float(top_p))
        if do_sample
        else dict(do_sample=False)
    )
    return dict(max_new_tokens=int(max_new_tokens), **sampling)


def prepare(model, tokenizer, message, history, settings: dict, block_size, mask_cost, lossless) -> Turn:
    """The request as generate() arguments, refused with a message if empty or too long."""
    history = list(history or [])
    if not message or not message.strip():
        raise gr.Error("Type a message first.")
    # Block size and max new tokens: their sliders' bounds, which Gradio enforces on every request, API included.
    inputs = encode(tokenizer, history, message)
    cost = dict(mars_mask_cost=float(mask_cost)) if mask_cost else {}  # 0: the default, also of older checkpoints
    # Lossless mode drafts with the checkpoint's own tree (generation_config.mars_lossless: block size, candidates
    # for the first draft, prompt lookup; `hf-mars tune` measures it), τ still from the slider
    tree = lossless_tree(model) if lossless else dict(mars_block_size=int(block_size), mars_lookup=0)
    verify = dict(mars_verify=True) if lossless else dict(mars_block_size=int(block_size))
    return Turn(
        history=history + [{"role": "user", "content": message}],
        inputs=inputs,
        settings=settings,
        mars=dict(**cost, **verify),
        tree=tree,
        lossless=lossless,
        mask_cost=mask_cost,
    )


def stream_mars(model, tokenizer, turn: Turn, session: Session):
    """Decode with a MARS runner (`model.mars_session`: the pass the checkpoint's `generate()` runs, compiled and
    captured on a GPU) pass by pass, yielding the outputs at most every UPDATE_EVERY seconds, with every pass since
    the last; the browser session's τ is read before every pass. Closed early (Stop, a closed tab), it stops between
    two passes. Returns the runner and the seconds its passes took (the UI's work between them is not the
    decoder's)."""

    def tau_now():  # read by the runner once before every forward pass
        turn.taus.append(session.tau)
        return turn.taus[-1]

    compile_config = CompileConfig() if model.device.type == "cuda" else None
    try:
        seconds, start = 0.0, time.perf_counter()
        shown = start
        with torch.inference_mode():  # the prompt's pass runs as the runner takes the row
            run = model.mars_session(
                **turn.inputs, **turn.settings, mars_tau=tau_now, **turn.mars, log=True, compile_config=compile_config
            )
        while True:
            ((_, ids, stopped, _),) = run.rows()
            seconds += time.perf_counter() - start
            add_pass(tokenizer, turn, ids[len(turn.ids) :])
            if stopped:
                break
            if time.perf_counter() - shown >= UPDATE_EVERY:
                yield live_outputs(turn, session, seconds)
                shown = time.perf_counter()
            start = time.perf_counter()
            with torch.inference_mode():
                run.step()
    except (ValueError, RuntimeError) as error:
        raise gr.Error(f"Generation failed: {error}") from error
    return run, seconds


def add_pass(tokenizer, turn: Turn, chunk: list[int]) -> None:
    """One forward pass's accepted tokens: one more span, unless they end inside a character."""
    turn.ids, turn.passes = turn.ids + chunk, turn.passes + 1
    text = tokenizer.decode(turn.ids, skip_special_tokens=True)
    if not text.endswith("\ufffd"):  # a character still incomplete waits for the next pass
        turn.spans.append((text[len(turn.shown) :], len(chunk)))
        turn.shown = text


def live_outputs(turn: Turn, session: Session, elapsed: float) -> tuple:
    """The outputs while MARS writes: the answer so far, its spans, figures and stats; the plots wait for its end."""
    new = len(turn.ids)
    stats = dict(
        decoder="MARS",
        done=False,
        new_tokens=new,
        forward_passes=turn.passes,
        seconds=elapsed,
        tokens_per_second=new / elapsed,
        tau_per_pass=turn.taus[: turn.passes],
        block_size=turn.block_size,
        lossless=turn.lossless,
        prompt_tokens=turn.prompt_tokens,
    )
    return (
        "",
        turn.history + [{"role": "assistant", "content": turn.shown}],
        spans_html(turn.spans, turn.most),
        figures("MARS", new, turn.passes, elapsed, f" · τ now {session.tau:.2f}"),
        stats,
        gr.skip(),
        gr.skip(),
    )


def final_stats(turn: Turn, mars, seconds: float) -> dict:
    """The finished run's stats as its session counted them (`MARSStats`), shown under "Per-pass details"."""
    new = len(turn.ids)
    return dict(
        decoder="MARS",
        done=True,
        new_tokens=new,
        forward_passes=mars.forward_passes,
        seconds=seconds,
        tokens_per_forward=new / mars.forward_passes,
        tokens_per_second=new / seconds,
        tau_per_pass=list(mars.tau_per_step),
        accepted_per_pass=[int(a[0]) for a in mars.accepted_per_step],
        masks_per_pass=list(getattr(mars, "masks_per_step", [])),
        mask_cost=turn.mask_cost,
        block_size=turn.block_size,
        lossless=turn.lossless,
        prompt_tokens=turn.prompt_tokens,
    )


def finish_mars(tokenizer, turn: Turn, run, seconds: float, session: Session) -> tuple:
    """The final outputs: the whole answer, its figures, a point on the plots, and what the AR comparison replays."""
    mars = run.record()
    stats = final_stats(turn, mars, seconds)
    mean_tau = sum(mars.tau_per_step) / len(mars.tau_per_step)
    record_run(session, "MARS", round(mean_tau, 3), stats["tokens_per_forward"], stats["tokens_per_second"])
    answer = tokenizer.decode(turn.ids, skip_special_tokens=True)
    if turn.spans and answer.startswith(turn.shown) and answer != turn.shown:  # a held-back incomplete character
        turn.spans[-1] = (turn.spans[-1][0] + answer[len(turn.shown) :], turn.spans[-1][1])
    session.last = dict(
        inputs=turn.inputs,
        settings=turn.settings,
        ids=turn.inputs["input_ids"][0].tolist() + turn.ids,
        tokens_per_second=stats["tokens_per_second"],
        exact=turn.lossless and not turn.settings.get("do_sample"),  # greedy verification: plain AR's text
    )
    return (
        "",
        turn.history + [{"role": "assistant", "content": answer}],
        spans_html(turn.spans, turn.most),
        figures("MARS", stats["new_tokens"], mars.forward_passes, seconds, f" · mean τ {mean_tau:.2f}"),
        stats,
        *[runs_frame(session)] * 2,
    )


def stream_ar(model, tokenizer, last: dict):
    """The last MARS run's inputs through transformers' own `GenerationMixin.generate` (plain AR, its own KV cache),
    in a thread; yields its text as it comes, returns the finished job."""
    stop = threading.Event()
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    job = in_thread(
        functools.partial(GenerationMixin.generate, model),
        streamer.text_queue,
        **last["inputs"],
        **last["settings"],
        streamer=streamer,
        stopping_criteria=[StopOn(stop)],
    )
    text, start = "", time.perf_counter()
    try:
        for batch in batches(streamer.text_queue):  # None: the streamer's end, or `in_thread`'s on error
            text += "".join(batch)
            yield (
                text,
                f"**plain AR generate()**: {time.perf_counter() - start:.2f} s so far",
                gr.skip(),
                gr.skip(),
            )
    finally:
        stop.set()
    job["thread"].join()
    if "error" in job:
        raise gr.Error(f"AR generation failed: {job['error']}")
    return job


def finish_ar(tokenizer, job: dict, last: dict, session: Session, dtype=torch.float32) -> tuple:
    """AR's final outputs: its answer, its figures against MARS's (speed-up, same text or not, and why not where
    lossless mode parted from AR outside float32), a plot point."""
    seconds, ids = job["seconds"], job["out"][0].tolist()
    new = len(ids) - last["inputs"]["input_ids"].shape[1]
    rate = new / seconds
    same = "identical to" if ids == last["ids"] else "differs from"
    if ids != last["ids"] and last.get("exact") and dtype != torch.float32:
        same += f" ({str(dtype).removeprefix('torch.')} {NEAR_TIE})"
    record_run(session, "AR generate()", 1.0, 1.0, rate)
    extra = f" · MARS speed-up **{last['tokens_per_second'] / rate:.2f}x** · output {same} MARS"
    return (
        tokenizer.decode(ids[-new:] if new else [], skip_special_tokens=True),
        figures("plain AR generate()", new, None, seconds, extra),
        *[runs_frame(session)] * 2,
    )


# The page, top to bottom: a header; the chat next to the settings; MARS's answer next to plain AR's; the plots;
# the last run's details. Each function lays out its part and returns its components by name.


def chat_column() -> dict:
    """Left of the settings: the chat, the message box and its buttons."""
    with gr.Column(scale=3):
        chatbot = gr.Chatbot(label="Chat", height=320, elem_id="chat")
        message = gr.Textbox(
            label="Message",
            placeholder="Ask something, then press Enter",
            max_length=4 * MAX_INPUT_TOKENS,
            elem_id="message",
        )
        with gr.Row():
            send, stop_button, clear = (
                gr.Button("Send", variant="primary"),
                gr.Button("Stop"),
                gr.Button("New chat"),
            )
    return dict(chatbot=chatbot, message=message, send=send, stop_button=stop_button, clear=clear)


def mars_settings(model) -> dict:
    """MARS's own settings, each slider's bounds enforced by Gradio on every request: τ, block size (at most the
    trained one), answer length, mask cost, lossless."""
    trained_block = int(model.config.mars_block_size)
    tau = gr.Slider(
        0.0,
        1.0,
        value=0.9,
        step=0.05,
        label="τ (confidence threshold)",
        info="lossless: how many guesses are drafted; lossless off (τ-mode): τ < 1 keeps guesses unchecked, "
        "faster but the answers change; 1 = plain AR; change it mid-answer",
        elem_id="tau",
    )
    block_size = gr.Slider(
        1,
        trained_block,
        value=trained_block,
        step=1,
        label="Block size (tokens per pass at most)",
        info=f"the model was trained with {trained_block}; lossless mode uses {tree_description(model)}",
    )
    max_new = gr.Slider(
        1, MAX_NEW_TOKENS, value=min(128, MAX_NEW_TOKENS), step=1, label="Max new tokens", elem_id="max-new"
    )
    mask_cost = gr.Slider(
        0.0,
        2.0,
        value=0.0,
        step=0.05,
        label="Mask cost (share of a one-token pass)",
        info="0 = B-1 masks every pass (the paper); above 0, a mask is fed only where "
        "its acceptance pays for its compute (CPU: about 0.7 in float32, near 0 in bfloat16)",
        elem_id="mask-cost",
    )
    lossless = gr.Checkbox(
        label="Lossless: verify the drafts (exactly the AR text, the answers kept)",
        value=True,
        elem_id="lossless",
        info="the masks' guesses, and text that repeats, are checked by the model in the "
        "next pass: τ sets how many are drafted, not the text",
    )
    return dict(tau=tau, block_size=block_size, max_new=max_new, mask_cost=mask_cost, lossless=lossless)


def settings_column(model) -> dict:
    """Right of the chat: MARS's settings, then sampling's and whether plain AR runs after."""
    with gr.Column(scale=2):
        settings = mars_settings(model)
        do_sample = gr.Checkbox(label="Sample", value=False)
        temperature = gr.Slider(0.05, 2.0, value=0.7, step=0.05, label="Temperature")
        top_p = gr.Slider(0.05, 1.0, value=0.95, step=0.05, label="Top p")
        compare = gr.Checkbox(label="Then run plain AR generate() on the same prompt", value=True)
    return dict(**settings, do_sample=do_sample, temperature=temperature, top_p=top_p, compare=compare)


def answers_row() -> dict:
    """MARS's answer as colored spans and its figures, next to plain AR's answer and figures."""
    with gr.Row():
        with gr.Column():
            mars_figures = gr.Markdown("**MARS**: waiting for a message", elem_id="mars-figures")
            mars_spans = gr.HTML(label="MARS answer: one span per forward pass", elem_id="mars-spans")
        with gr.Column():
            ar_figures = gr.Markdown("**plain AR generate()**: runs after MARS", elem_id="ar-figures")
            ar_text = gr.Textbox(label="plain AR answer", lines=6, interactive=False, elem_id="ar-text")
    return dict(mars_figures=mars_figures, mars_spans=mars_spans, ar_figures=ar_figures, ar_text=ar_text)


def plots_row(trained_block: int) -> dict:
    """The session's runs against τ, both decoders: tokens per forward pass, and tokens per second."""
    with gr.Row():
        plot_kw = dict(
            value=runs_frame(Session()),
            x="tau",
            color="decoder",
            x_lim=[0, 1.05],
            height=240,
            color_map=dict(zip(DECODERS, ["#f97316", "#475569"])),
        )
        per_forward = gr.ScatterPlot(
            y="tokens_per_forward",
            title="tokens per forward vs τ (your runs)",
            elem_id="plot-forward",
            y_lim=[0, trained_block],
            **plot_kw,
        )
        per_second = gr.ScatterPlot(
            y="tokens_per_second", title="tokens/s vs τ (your runs)", elem_id="plot-speed", **plot_kw
        )
    return dict(per_forward=per_forward, per_second=per_second)


def handlers(model, tokenizer):
    """The two generating events' functions, over the shared model: MARS's answer in its three phases, then plain AR.
    Their names and parameters are the API's (/respond, /compare_ar)."""

    def respond(
        message,
        history,
        tau,
        block_size,
        max_new_tokens,
        do_sample,
        temperature,
        top_p,
        mask_cost,
        lossless,
        session: Session,
    ):
        """Stream the MARS answer pass by pass; the session's τ is read before every pass. Lossless: drafts verified
        by the model itself, so the text is plain AR's (greedy) or distributed as its samples."""
        settings = sampling_settings(max_new_tokens, do_sample, temperature, top_p)
        turn = prepare(model, tokenizer, message, history, settings, block_size, mask_cost, lossless)
        session.tau = float(tau)
        run, seconds = yield from stream_mars(model, tokenizer, turn, session)
        yield finish_mars(tokenizer, turn, run, seconds, session)

    def compare_ar(compare, session: Session):
        """The same inputs through transformers' own `GenerationMixin.generate` (plain AR, its own KV cache)."""
        if not compare or session.last is None:
            yield gr.skip(), gr.skip(), gr.skip(), gr.skip()
            return
        last = session.last
        job = yield from stream_ar(model, tokenizer, last)
        yield finish_ar(tokenizer, job, last, session, model.dtype)

    return respond, compare_ar


def wire_events(model, tokenizer, ui: SimpleNamespace) -> None:
    """The event chain: τ's own event; Enter or Send runs MARS, then plain AR; Stop cancels both; New chat clears."""
    respond, compare_ar = handlers(model, tokenizer)
    ui.tau.change(
        set_tau, [ui.tau, ui.session], None, api_name="set_tau", concurrency_limit=None, show_progress="hidden"
    )
    plot_outputs = [ui.per_forward, ui.per_second]
    mars_inputs = [ui.message, ui.chatbot, ui.tau, ui.block_size, ui.max_new, ui.do_sample, ui.temperature, ui.top_p]
    mars_event = gr.on(
        [ui.message.submit, ui.send.click],
        respond,
        [*mars_inputs, ui.mask_cost, ui.lossless, ui.session],
        [ui.message, ui.chatbot, ui.mars_spans, ui.mars_figures, ui.stats, *plot_outputs],
        api_name="respond",
    )
    ar_event = mars_event.then(
        compare_ar, [ui.compare, ui.session], [ui.ar_text, ui.ar_figures, *plot_outputs], api_name="compare_ar"
    )
    ui.stop_button.click(None, cancels=[mars_event, ar_event], api_visibility="private")
    ui.clear.click(
        lambda: ([], "", "", None), None, [ui.chatbot, ui.mars_spans, ui.ar_text, ui.stats], api_visibility="private"
    )


def build_demo(model, tokenizer) -> gr.Blocks:
    """The app around a loaded MARS model (shared read-only by every session); `launch()` it, or test it."""
    with gr.Blocks(title="MARS: several tokens per forward pass") as demo:
        session = gr.State(Session())  # deep-copied for each browser session
        gr.Markdown(
            "# MARS: Mask AutoRegression\n"
            "The model appends `<|mask|>` tokens and keeps the predictions it is at least "
            "τ sure of: several tokens per forward pass. **τ = 1 is this checkpoint's own one-token decoding**; move the slider "
            "while an answer is written and watch the passes change."
            f" *{str(model.dtype).removeprefix('torch.')} on {model.device.type}.*"
        )
        with gr.Row():
            chat, settings = chat_column(), settings_column(model)
        answers, plots = answers_row(), plots_row(int(model.config.mars_block_size))
        with gr.Accordion("Per-pass details", open=False):
            stats = gr.JSON(label="last MARS run")
        ui = SimpleNamespace(session=session, stats=stats, **chat, **settings, **answers, **plots)
        wire_events(model, tokenizer, ui)
    return demo


def load_model(path: str | None = None, revision: str | None = None):
    """MARS_MODEL (or `path`), else the published checkpoint, else hf_mars's shipped one (when hf_mars is installed),
    else `hf-mars demo`'s output folder."""
    path = path or os.environ.get("MARS_MODEL") or DEFAULT_MODEL
    if path is None:
        try:
            from hf_mars import default_checkpoint  # a local run from the project: its shipped SmolLM2 checkpoint
        except ImportError:
            pass
        else:
            path = str(default_checkpoint())
    if path is None:
        local = [p for p in (Path(DEMO_OUTPUT), Path(__file__).resolve().parent.parent / DEMO_OUTPUT) if p.is_dir()]
        if not local:
            raise SystemExit(
                "No MARS checkpoint: set MARS_MODEL to a Hub repo id or folder (or pass --model), "
                "or run `hf-mars demo` to train a toy one into outputs/mars-demo."
            )
        path = str(local[0])
    revision = revision or os.environ.get("MARS_REVISION") or None
    dtype = os.environ.get("MARS_DTYPE", "auto")
    if dtype not in DTYPES:
        raise SystemExit(f"MARS_DTYPE must be one of {', '.join(DTYPES)}, not {dtype!r}.")
    attention = os.environ.get("MARS_ATTENTION") or None
    if attention not in (None, *ATTENTIONS):
        raise SystemExit(f"MARS_ATTENTION must be one of {', '.join(ATTENTIONS)}, not {attention!r}.")
    tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
    model = AutoModelForCausalLM.from_pretrained(
        path, revision=revision, trust_remote_code=True, dtype=getattr(torch, dtype, torch.float32)
    ).eval()
    if attention is not None:  # "ordered" is registered by the checkpoint's code, imported just now
        model.set_attn_implementation(attention)
    if (
        getattr(model.config, "mars_block_size", None) is None
        or getattr(model.config, "mars_mask_token_id", None) is None
    ):
        raise SystemExit(f"{path} is not a MARS checkpoint (its config has no mars_block_size / mars_mask_token_id).")
    return (in_fastest_dtype(model) if dtype == "auto" else model), tokenizer


def in_fastest_dtype(model):
    """MARS_DTYPE=auto: the dtype where lossless decoding is expected fastest on this machine, from pass costs timed
    here by hf_mars's tools (cached after the first start); float32 where hf_mars is not importable."""
    tools = timing_tools()
    if tools is None:
        print(f"MARS_DTYPE=auto: {NO_TIMING}; float32", file=sys.stderr)
        return model
    choice = tools.choose_dtype(model)
    print(f"MARS_DTYPE=auto: {choice.reason()}", file=sys.stderr)
    return model.to(choice.dtype)


NO_TIMING = "timing pass costs needs hf_mars (`hf-mars push-space` uploads it beside this app)"


def timing_tools():
    """hf_mars, which times pass costs (a checkpoint's code only reads them), where it is importable: uploaded beside
    this app by `hf-mars push-space`, or installed; None elsewhere."""
    try:
        import hf_mars
    except ImportError:
        return None
    return hf_mars


def main(argv: list[str] | None = None) -> None:
    """`python app.py`, as a Space runs it: load the checkpoint, warm it up, serve."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="MARS checkpoint: Hub repo id or folder (default: $MARS_MODEL)")
    parser.add_argument(
        "--revision", help="pin a Hub revision: the checkpoint's code runs here (default: $MARS_REVISION)"
    )
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model, args.revision)
    warm_up(model, tokenizer)
    serve(build_demo(model, tokenizer))


def warm_up(model, tokenizer) -> None:
    """One tiny call down each path, so that the first visitor's timings do not include one-off set-up costs."""
    inputs = tokenizer("Hello", return_tensors="pt")
    tools = timing_tools()
    if tools is not None:  # what lossless "auto" reads, timed once per machine (generate() never times)
        tools.measure(model, [1], mars_verify=True)
    else:
        said = 'lossless "auto" chooses from what is known of this kind of device until pass costs are timed'
        print(f"{said}: {NO_TIMING}", file=sys.stderr)
    model.generate(**inputs, max_new_tokens=2, mars_tau=0.5, do_sample=False)
    GenerationMixin.generate(model, **inputs, max_new_tokens=2, do_sample=False)


def serve(demo: gr.Blocks, **launch_kwargs):
    """Queue (at most CONCURRENCY generations at once, each listener its own group) and launch; host and port come
    from GRADIO_SERVER_NAME / GRADIO_SERVER_PORT unless given."""
    return demo.queue(default_concurrency_limit=CONCURRENCY, max_size=64).launch(css=CSS, **launch_kwargs)


if __name__ == "__main__":
    main()
