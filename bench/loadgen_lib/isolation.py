"""The sans-IO part of ``bench/isolation.py``: the heavy requests, the gap arithmetic, the
reading of ``/metrics``.

Theory of operation
-------------------
Background streams run the whole time; each content event's arrival time is kept (the
stream tracker's ``first`` and ``gaps``). A *phase* is a time window ``[a, b]``: the baseline
(no heavy request), or one heavy request's flight from its first byte sent to its last byte
received (plus a short tail). What a phase did to the other streams is read from the gaps
between consecutive events of one stream that **overlap** the window (the later event after
``a``, the earlier before ``b``): a stall that began before the window or lasted beyond it
still counts in full. A stream that ended in an error, or was still running when the run
stopped, has one more point, its end (or the stop): a stream that went silent is a gap
too. A stream's time to its first event is not a gap (it is a new stream's queueing).

:func:`window_gaps` does that on plain lists of times, so it is tested without a server.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_right

from .stats import percentile

__all__ = ["HEAVY_KINDS", "DEFAULT_KINDS", "TOKENIZE_CHARS", "HeavyRequest", "heavy_request", "stream_points",
           "window_gaps", "largest_gap", "windows_max_gaps", "gap_summary", "worker_restarts"]


class HeavyRequest:
    """One heavy request: where it goes, its body, and what it is."""

    __slots__ = ("kind", "path", "body", "what")

    def __init__(self, kind: str, path: str, body: bytes, what: str) -> None:
        self.kind = kind
        self.path = path
        self.body = body
        self.what = what


def _dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _chat(model: str, schema: dict, name: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Fill in the form."}],
            "max_tokens": 16,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": name, "strict": True,
                                                "schema": schema}}}


def _schema_wide(n: int = 2000) -> dict:
    props = {f"f{i}": {"type": "string"} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def _schema_deep(depth: int = 300) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _schema_enum(n: int = 100_000) -> dict:
    return {"type": "object", "properties": {"v": {"enum": [f"v{i}" for i in range(n)]}},
            "required": ["v"]}


#: The ``tokenize`` kind's prompt, in characters (one word): the issue's 3.5 MB.
TOKENIZE_CHARS = 3_500_000


def heavy_request(kind: str, model: str, tokenize_chars: int = TOKENIZE_CHARS) -> HeavyRequest:
    """The heavy request of ``kind`` (one of :data:`HEAVY_KINDS`), its body built now;
    ``tokenize_chars``: the ``tokenize`` kind's prompt length."""
    if kind == "schema":
        body = _dumps(_chat(model, _schema_wide(), "wide"))
        return HeavyRequest(kind, "/v1/chat/completions", body,
                            "chat, response_format json_schema of 2,000 string properties")
    if kind == "schema-deep":
        body = _dumps(_chat(model, _schema_deep(), "deep"))
        return HeavyRequest(kind, "/v1/chat/completions", body,
                            "chat, response_format json_schema nested 300 deep")
    if kind == "schema-enum":
        body = _dumps(_chat(model, _schema_enum(), "enum"))
        return HeavyRequest(kind, "/v1/chat/completions", body,
                            "chat, response_format json_schema with a 100,000-value enum")
    if kind == "tokenize":
        body = _dumps({"model": model, "prompt": "x" * tokenize_chars})
        return HeavyRequest(kind, "/tokenize", body,
                            f"/tokenize of a {tokenize_chars / 1e6:g} MB one-word prompt")
    if kind == "token-strs":
        body = _dumps({"model": model, "prompt": "x" * tokenize_chars,
                       "return_token_strs": True})
        return HeavyRequest(kind, "/tokenize", body,
                            f"/tokenize of a {tokenize_chars / 1e6:g} MB one-word prompt, "
                            "return_token_strs")
    if kind == "token-ids":
        body = _dumps({"model": model, "prompt": [1] * 1_900_000, "max_tokens": 1})
        return HeavyRequest(kind, "/v1/completions", body,
                            "completions, prompt of 1.9M token ids")
    if kind == "logprobs":
        body = _dumps({"model": model, "prompt": "Write a long story.", "n": 16,
                       "max_tokens": 900, "logprobs": 20, "ignore_eos": True})
        return HeavyRequest(kind, "/v1/completions", body,
                            "completions, n=16 x 900 tokens, logprobs 20 (not streamed)")
    raise ValueError(f"unknown heavy kind {kind!r} (known: {', '.join(HEAVY_KINDS)})")


#: Every kind, in the order they run; the issue's four are :data:`DEFAULT_KINDS`.
HEAVY_KINDS = ("schema", "tokenize", "token-ids", "logprobs", "schema-deep", "schema-enum",
               "token-strs")
DEFAULT_KINDS = HEAVY_KINDS[:4]


def stream_points(first: float | None, gaps, end: float | None) -> list[float]:
    """A stream's content event times, from its first event time and its gaps, then
    ``end`` (when it ended in an error, or is still running: see the module docstring)."""
    if first is None:
        return []
    points = [first]
    t = first
    for gap in gaps:
        t += gap
        points.append(t)
    if end is not None and end > t:
        points.append(end)
    return points


def window_gaps(streams, a: float, b: float) -> list[float]:
    """The gaps between consecutive points of each stream (``streams``: ascending lists of
    times) that overlap the window ``[a, b]``: later point after ``a``, earlier before
    ``b``."""
    out = []
    for points in streams:
        if len(points) < 2 or points[-1] <= a or points[0] >= b:
            continue
        i = max(bisect_right(points, a), 1)  # the first point after `a` ends the first gap
        n = len(points)
        while i < n and points[i - 1] < b:
            out.append(points[i] - points[i - 1])
            i += 1
    return out


def largest_gap(streams, a: float, b: float) -> tuple[float, float] | None:
    """The largest gap of :func:`window_gaps` as ``(start, end)`` times; None if none."""
    best = None
    for points in streams:
        prev = None
        for t in points:
            if prev is not None and t > a and prev < b and (best is None or
                                                            t - prev > best[1] - best[0]):
                best = (prev, t)
            if t >= b:
                break
            prev = t
    return best


def windows_max_gaps(streams, a: float, b: float, width: float) -> list[float]:
    """The largest gap (s) of each window of ``width`` seconds that tiles ``[a, b]`` from
    ``b`` back (whole windows only): what a window of that length sees anywhere in a long
    phase, to compare its last window with (is the end worse than the rest?)."""
    out = []
    end = b
    while end - width >= a:
        gaps = window_gaps(streams, end - width, end)
        if gaps:
            out.append(max(gaps))
        end -= width
    return out


def baseline_reference(streams, a: float, b: float, width: float) -> tuple[float, int] | None:
    """What a heavy phase of ``width`` seconds is compared with: the median of the largest
    gaps of the baseline's (``[a, b]``) whole windows of that width, and their count; the
    baseline's own largest gap (count 1) when it is shorter than the phase; None when it has
    no gap. The largest gap of a window grows with its length (the streams' rare slow steps,
    the cycle of their lengths), so a 70 s phase against a 5 s baseline "added" gap that no
    heavy request made, and a 1 s phase against it hid some."""
    maxima = windows_max_gaps(streams, a, b, width)
    if not maxima:
        gaps = window_gaps(streams, a, b)
        return (max(gaps), 1) if gaps else None
    ordered = sorted(maxima)
    n = len(ordered)
    median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    return median, n


def gap_summary(gaps) -> dict:
    """Largest gap and p99, in milliseconds (None when there are none), and their count."""
    ordered = sorted(gaps)
    p99 = percentile(ordered, 99)
    return {"gaps": len(ordered),
            "max_gap_ms": round(ordered[-1] * 1000, 2) if ordered else None,
            "p99_gap_ms": round(p99 * 1000, 2) if p99 is not None else None}


_RESTARTS = re.compile(rb"^trio_llm:worker_restarts_total\{[^}]*\} ([0-9.eE+]+)\s*$", re.M)


def worker_restarts(metrics_text: bytes) -> int | None:
    """Worker restarts summed over the workers, from a ``/metrics`` page (None: absent)."""
    values = _RESTARTS.findall(metrics_text)
    if not values:
        return None
    return int(sum(float(v) for v in values))
