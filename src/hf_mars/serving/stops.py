"""Stop sequences as OpenAI's API applies them: the text a client receives ends before the first stop sequence.

The engine stops a row at the token that completes a stop sequence (as `generate()` does: that token is decoded and
counts in `usage`), and the client's text is cut before the sequence, as OpenAI's API and vLLM cut it. A stream cannot
take back text it sent, so text that may be the beginning of a stop sequence is held back until the next text shows
whether it is.
"""

from __future__ import annotations


class StopText:
    """Text arriving piece by piece, passed on (`send`) up to the first stop sequence, never past it."""

    def __init__(self, stops: list[str], send):
        self.stops, self.send = [s for s in stops if s], send
        self.held, self.stopped = "", False

    def put(self, text: str) -> None:
        if self.stopped:
            return
        self.held += text
        found = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped, out, self.held = True, self.held[: min(found)], ""
        else:
            keep = max((n for s in self.stops for n in range(1, len(s)) if self.held.endswith(s[:n])), default=0)
            out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        if out:
            self.send(out)

    def end(self) -> None:
        """No more text: what was held back was no stop sequence."""
        if not self.stopped and self.held:
            self.send(self.held)
        self.held = ""


def cut_at_stop(text: str, stops: list[str]) -> str:
    """`text` up to its first stop sequence."""
    parts: list[str] = []
    cut = StopText(stops, parts.append)
    cut.put(text)
    cut.end()
    return "".join(parts)


class StopQueue:
    """What a `DirectStreamer` puts its text into, for a request with stop sequences: text goes to the handler's queue
    through `StopText`; the end of the stream (None) and everything else (errors, a parser's events) as it comes."""

    def __init__(self, queue, stops: list[str]):
        self.queue, self.text = queue, StopText(stops, queue.put_nowait)

    def put_nowait(self, item) -> None:
        if isinstance(item, str):
            self.text.put(item)
            return
        if item is None:
            self.text.end()
        self.queue.put_nowait(item)
