"""Stop strings on streamed text, shared by the engines. Sans-IO.

Text arrives in pieces (one token's worth at a time); a stop string may span pieces. A
:class:`StopMatcher` releases only text that cannot be the start of a stop string, holds the
rest back until it is decided, and cuts at the first stop string found: the stop string and
anything after it are never released.

    m = StopMatcher(("\\n\\n",))
    m.feed("Hello\\n")     # ("Hello", False): "\\n" may begin a stop string, held back
    m.feed("\\nWorld")     # ("", True): stop string found; nothing more to send
    m.flush()             # at the end without a stop: what is still held back
"""

from __future__ import annotations

__all__ = ["StopMatcher"]


class StopMatcher:
    __slots__ = ("stops", "_longest", "_held")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self.stops), default=0)
        self._held = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """Add a piece; returns (text safe to release now, a stop string was found)."""
        text = self._held + piece
        cut = -1
        for s in self.stops:
            i = text.find(s)
            if i != -1 and (cut == -1 or i < cut):
                cut = i
        if cut != -1:
            self._held = ""
            return text[:cut], True
        keep = 0  # the longest tail of text that could begin a stop string
        for k in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                keep = k
                break
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The request ended without a stop string: release what was held back."""
        held, self._held = self._held, ""
        return held
