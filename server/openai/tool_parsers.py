"""Tool calls parsed out of a model's text, incrementally. Sans-IO.

Example::

    p = ToolCallParser("hermes")
    p.feed('Sure.<tool_call>{"name": "get_weather", "argu')
    # ("Sure.", [{"index": 0, "id": "call_...", "type": "function",
    #             "function": {"name": "get_weather", "arguments": ""}}])
    p.feed('ments": {"city": "Paris"}}</tool_call>')
    # ("", [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}])
    p.finish()   # ("", []): what was held back at the end
    p.calls      # 1

Theory of operation
-------------------
``feed`` takes text deltas and returns ``(content, tool_call_deltas)``: the content decided
so far, and deltas in OpenAI's streaming shape (a call's first delta has its ``index``,
``id``, ``type`` and ``function.name`` with ``arguments: ""``; later ones carry argument
fragments). Every decision is taken at a position in the text, never at a feed boundary,
so any way of cutting the text into deltas gives the same content and the same calls as
the whole text at once (the tests feed every split); the non-streaming answer is the
whole text fed once (:func:`parse_text`).

Formats (``--tool-call-parser``, vLLM's names):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number,
  anywhere in the text; the rest is content (Qwen2.5, Qwen3, Hermes);
- ``mistral``: content, then ``[TOOL_CALLS]`` and a JSON array ``[{"name": ...,
  "arguments": {...}}, ...]`` (Mistral 7B v0.3, Nemo, Small: the tokenizers before v11;
  the later ``[TOOL_CALLS]name[ARGS]{...}`` form is not parsed: it stays content);
- ``llama3_json``: the output *starts* (after blanks) with ``{"name": ..., "parameters":
  {...}}``, optionally after ``<|python_tag|>``; several are separated by ``;``. An output
  that does not start so is all content;
- ``forced`` (internal): the JSON array ``[{"name": ..., "arguments": {...}}, ...]`` that
  the grammar of ``tool_choice: required`` or a named function forces;
- ``calls_or_document`` (internal, :class:`CallsOrDocument`): ``tool_choice: auto`` with a
  JSON ``response_format``, whose grammar (:func:`server.openai.tools.calls_or_document`)
  lets the model write either the ``forced`` array or the document (all content).

A call is committed once its head ``{"name": "<string>", "arguments": {`` (or
``"parameters"``) is complete; then the raw text of its arguments object streams, up to its
closing brace (brace depth outside strings), so the fragments concatenate to exactly the
final ``arguments``. A head that cannot be one is content, tags included (as vLLM answers an
unparsable call). Possible tag beginnings at the end of a delta are held back; blanks before
a call, and at the end after calls, are dropped. docs/tools.md has the details and the
decisions on malformed calls.

With ``parallel=False`` only the first call is returned; later ones are parsed and dropped.
"""

from __future__ import annotations

import json
import os
import re

__all__ = [
    "CALLS_OR_DOCUMENT", "PARSERS", "CallsOrDocument", "ToolCallParser", "accumulate",
    "new_call_id", "new_parser", "parse_text",
]

#: The formats ``--tool-call-parser`` takes.
PARSERS = ("hermes", "llama3_json", "mistral")
#: The internal format of ``tool_choice: auto`` with a JSON ``response_format``.
CALLS_OR_DOCUMENT = "calls_or_document"

OPEN = "<tool_call>"
MISTRAL_TAG = "[TOOL_CALLS]"
CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_ARG_KEYS = ('"arguments"', '"parameters"')

#: A call's head (from its ``{`` to its arguments' ``{``) must fit in this many characters,
#: and at most this many blanks may open a llama3_json or forced answer: past them the
#: text is not a call. Without a bound, text that keeps a head undecided (blanks, a name of
#: escapes) would be scanned again at every delta: quadratic, on the event loop.
MAX_HEAD = 1024

_IN_STRING = re.compile(r'["\\]')
_STRUCTURE = re.compile(r'[{}"]')
_BLANKS = " \t\r\n"


def new_call_id() -> str:
    """An id for a tool call, in OpenAI's ``call_...`` shape."""
    return "call_" + os.urandom(12).hex()


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _blanks(s: str, i: int) -> int:
    n = len(s)
    while i < n and s[i] in _BLANKS:
        i += 1
    return i


def _head(s: str) -> tuple[str, str, int]:
    """Match a call's head at the start of ``s`` (which starts with ``{``): ``("ok", name,
    end)`` with ``end`` the index of the arguments' ``{``; ``("more", "", 0)`` when ``s`` is
    a proper beginning of a head; ``("bad", "", 0)`` when it cannot be one."""
    more = ("more", "", 0)
    bad = ("bad", "", 0)
    i = _blanks(s, 1)
    for literal in ('"name"', ":"):
        if s.startswith(literal, i):
            i = _blanks(s, i + len(literal))
        elif literal.startswith(s[i:]):
            return more
        else:
            return bad
    if i >= len(s):
        return more
    if s[i] != '"':
        return bad
    j = i + 1
    while True:  # the name string, escapes and all
        m = _IN_STRING.search(s, j)
        if m is None:
            return more
        j = m.start()
        if s[j] == "\\":
            j += 2
            continue
        break
    if j >= len(s):
        return more
    try:
        name = json.loads(s[i : j + 1])
    except ValueError:
        return bad
    i = _blanks(s, j + 1)
    if i >= len(s):
        return more
    if s[i] != ",":
        return bad
    i = _blanks(s, i + 1)
    for key in _ARG_KEYS:
        if s.startswith(key, i):
            i = _blanks(s, i + len(key))
            break
        if key.startswith(s[i:]):
            return more
    else:
        return bad
    if i >= len(s):
        return more
    if s[i] != ":":
        return bad
    i = _blanks(s, i + 1)
    if i >= len(s):
        return more
    if s[i] != "{":
        return bad
    return "ok", name, i


class ToolCallParser:
    """One choice's text split into content and tool calls (see the module docstring)."""

    __slots__ = (
        "_fmt", "_limit", "_state", "_buf", "_raw", "_held", "_ended", "_depth", "_in_str",
        "_esc", "_content", "_deltas", "calls", "_make_id", "_tag", "_array",
    )

    def __init__(self, fmt: str, *, parallel: bool = True, make_id=new_call_id) -> None:
        if fmt not in PARSERS and fmt != "forced":
            raise ValueError(f"unknown tool call format {fmt!r}")
        self._fmt = fmt
        self._limit = None if parallel else 1
        self._state = "text" if fmt in ("hermes", "mistral") else "start"
        self._tag = MISTRAL_TAG if fmt == "mistral" else OPEN  # what opens calls in text
        self._array = fmt in ("forced", "mistral")  # calls in a JSON array
        self._buf = ""
        self._raw = ""  # the text since a call's opening, in case it is not one
        self._held = ""  # blanks at the end of the content, held back
        self._ended = False
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._content: list[str] = []
        self._deltas: list[dict] = []
        self._make_id = make_id
        #: The calls started so far (returned ones only).
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """Add a text delta; returns (content, tool call deltas) decided now."""
        self._buf += text
        return self._run()

    def finish(self) -> tuple[str, list[dict]]:
        """The text ended: decide what was held back."""
        self._ended = True
        content, deltas = self._run()
        if self._held and not self.calls:
            content += self._held
        self._held = ""
        return content, deltas

    # -- the machine ------------------------------------------------------------------------

    def _run(self) -> tuple[str, list[dict]]:
        step = getattr(self, "_st_" + self._state)
        while step():
            step = getattr(self, "_st_" + self._state)
        content = "".join(self._content)
        deltas = self._deltas
        self._content = []
        self._deltas = []
        return content, deltas

    def _say(self, text: str) -> None:
        """Content; its blanks at the end are held until more content follows (dropped
        when a call starts, and at the end after calls). The ``forced`` format has none:
        what is not a call there (a head cut by max_tokens) is dropped."""
        if self._fmt == "forced":
            return
        text = self._held + text
        kept = text.rstrip(_BLANKS)
        self._held = text[len(kept):]
        if kept:
            self._content.append(kept)

    def _fallback(self, text: str) -> None:
        """What looked like a call's opening is not one: its text is content."""
        self._say(self._raw + text)
        self._raw = ""

    def _start_call(self, name: str) -> None:
        self._held = ""
        if self._limit is None or self.calls < self._limit:
            self._deltas.append({
                "index": self.calls, "id": self._make_id(), "type": "function",
                "function": {"name": name, "arguments": ""},
            })
        self.calls += 1

    def _fragment(self, fragment: str) -> None:
        index = self.calls - 1
        if not fragment or (self._limit is not None and index >= self._limit):
            return
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last["index"] == index and "id" not in last:
            last["function"]["arguments"] += fragment
        else:
            self._deltas.append({"index": index, "function": {"arguments": fragment}})

    # Each state's step consumes from _buf; True: go on, False: wait for more text.

    def _st_text(self) -> bool:  # hermes and mistral, outside calls
        buf = self._buf
        tag = self._tag
        i = buf.find(tag)
        if i >= 0:
            self._say(buf[:i])
            self._buf = buf[i + len(tag):]
            self._raw = tag
            self._state = "open" if self._fmt == "hermes" else "bracket"
            return True
        keep = 0 if self._ended else _partial_suffix(buf, tag)
        self._say(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False

    def _st_start(self) -> bool:  # llama3_json and forced, at the beginning
        buf = self._buf
        i = _blanks(buf, 0)
        if i > MAX_HEAD:
            self._state = "content"
            return True
        rest = buf[i:]
        if not rest:
            if self._ended:
                self._say(buf)
                self._buf = ""
            return False
        if self._fmt == "forced":
            if rest[0] == "[":
                self._raw, self._buf, self._state = buf[: i + 1], rest[1:], "open"
            else:
                self._state = "content"
            return True
        if rest.startswith(PYTHON_TAG):
            self._raw, self._buf = buf[: i + len(PYTHON_TAG)], rest[len(PYTHON_TAG):]
            self._state = "open"
            return True
        if PYTHON_TAG.startswith(rest) and not self._ended:
            return False
        self._state = "open" if rest[0] == "{" else "content"
        return True

    def _st_bracket(self) -> bool:  # mistral, after [TOOL_CALLS]: the array's "["
        buf = self._buf
        i = _blanks(buf, 0)
        if i == len(buf):
            if self._ended:
                self._fallback(buf)
            else:
                self._raw += buf
            self._buf = ""
            return False
        if buf[i] == "[":
            self._raw += buf[: i + 1]
            self._buf = buf[i + 1:]
            self._state = "open"
        else:  # not the array form: the tag and the rest are content
            self._fallback("")
            self._state = "content"
        return True

    def _st_open(self) -> bool:  # before a call's "{"
        buf = self._buf
        i = _blanks(buf, 0)
        if i == len(buf):
            if self._ended:
                self._fallback(buf)
            else:  # blanks: part of the opening, whatever it turns out to be
                self._raw += buf
            self._buf = ""
            return False
        if buf[i] == "{":
            self._raw += buf[:i]
            self._buf = buf[i:]
            self._state = "head"
        elif self._array and buf[i] == "]":
            self._state = "done"
        elif self._fmt == "hermes":
            self._say(self._raw + buf[:i])
            self._raw = ""
            self._buf = buf[i:]
            self._state = "text"
        else:
            self._fallback("")
            self._state = "content"
        return True

    def _st_head(self) -> bool:
        buf = self._buf
        status, name, end = _head(buf[:MAX_HEAD])
        if status == "more" and len(buf) >= MAX_HEAD:
            status = "bad"  # a head cannot end past MAX_HEAD: the same for any split
        if status == "more" and not self._ended:
            return False
        if status == "ok":
            self._raw = ""
            self._start_call(name)
            self._buf = buf[end:]
            self._depth, self._in_str, self._esc = 0, False, False
            self._state = "args"
            return True
        if self._fmt == "hermes":  # not a call: its opening is content, the rest is text
            self._fallback("")
            self._state = "text"
        else:
            self._fallback("")
            self._state = "content"
        return True

    def _scan(self, buf: str) -> int:
        """Scan ``buf`` through the arguments object; returns how much of it belongs to it
        (``_depth`` 0 afterwards when it closed)."""
        n = len(buf)
        i = 0
        depth, in_str = self._depth, self._in_str
        if self._esc and n:
            self._esc = False
            i = 1
        while i < n:
            if in_str:
                m = _IN_STRING.search(buf, i)
                if m is None:
                    i = n
                    break
                j = m.start()
                if buf[j] == "\\":
                    if j + 1 >= n:
                        self._esc = True
                        i = n
                        break
                    i = j + 2
                    continue
                in_str = False
                i = j + 1
                continue
            m = _STRUCTURE.search(buf, i)
            if m is None:
                i = n
                break
            j = m.start()
            c = buf[j]
            i = j + 1
            if c == '"':
                in_str = True
            elif c == "{":
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    break
        self._depth, self._in_str = depth, in_str
        return i

    def _st_args(self) -> bool:
        buf = self._buf
        i = self._scan(buf)
        self._fragment(buf[:i])
        self._buf = buf[i:]
        if self._depth == 0 and i:
            self._depth = 1  # inside the call object, after its arguments
            self._state = "rest"
            return True
        return False

    def _st_rest(self) -> bool:  # the call object after its arguments: dropped
        buf = self._buf
        i = self._scan(buf)
        self._buf = buf[i:]
        if self._depth == 0 and i:
            self._state = "close" if self._fmt == "hermes" else "after"
            return True
        return False

    def _st_close(self) -> bool:  # hermes: up to </tool_call>, dropped
        buf = self._buf
        i = buf.find(CLOSE)
        if i >= 0:
            self._buf = buf[i + len(CLOSE):]
            self._state = "text"
            return True
        self._buf = buf[len(buf) - _partial_suffix(buf, CLOSE):]
        return False

    def _st_after(self) -> bool:  # llama3_json, mistral and forced, between calls
        buf = self._buf
        i = _blanks(buf, 0)
        if i == len(buf):  # blanks between calls are dropped
            self._buf = ""
            return False
        c = buf[i]
        if c == (";" if self._fmt == "llama3_json" else ","):
            self._raw, self._buf, self._state = "", buf[i + 1:], "open"
        elif self._array and c == "]":
            self._state = "done"
        else:
            self._buf = buf[i:]
            self._state = "content"
        return True

    def _st_content(self) -> bool:
        self._say(self._buf)
        self._buf = ""
        return False

    def _st_done(self) -> bool:
        self._buf = ""
        return False


class CallsOrDocument:
    """The parser of ``tool_choice: auto`` with a JSON ``response_format`` (its grammar:
    :func:`server.openai.tools.calls_or_document`): the JSON starts with ``[`` for the
    calls array (parsed as the ``forced`` format) or ``{`` for the document (all content).
    The same interface as :class:`ToolCallParser`."""

    __slots__ = ("_parallel", "_parser", "_buf")

    def __init__(self, parallel: bool) -> None:
        self._parallel = parallel
        self._parser: ToolCallParser | None = None
        self._buf: str | None = ""  # until the first character decides; None: the document

    @property
    def calls(self) -> int:
        return self._parser.calls if self._parser is not None else 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self._parser is not None:
            return self._parser.feed(text)
        if self._buf is None:
            return text, []
        self._buf += text
        rest = self._buf.lstrip()
        if not rest:
            return "", []
        text, self._buf = self._buf, None
        if rest[0] != "[":
            return text, []
        self._parser = ToolCallParser("forced", parallel=self._parallel)
        return self._parser.feed(text)

    def finish(self) -> tuple[str, list[dict]]:
        if self._parser is not None:
            return self._parser.finish()
        held, self._buf = self._buf or "", None
        return held, []


def new_parser(fmt: str, *, parallel: bool = True) -> ToolCallParser | CallsOrDocument:
    """The parser of one choice's text in format ``fmt`` (a --tool-call-parser name,
    ``forced`` or :data:`CALLS_OR_DOCUMENT`)."""
    if fmt == CALLS_OR_DOCUMENT:
        return CallsOrDocument(parallel)
    return ToolCallParser(fmt, parallel=parallel)


def accumulate(calls: list[dict], deltas: list[dict]) -> None:
    """Merge streaming deltas into whole calls (``calls``, by index), as a client does."""
    for d in deltas:
        if "id" in d:
            calls.append({"id": d["id"], "type": "function",
                          "function": dict(d["function"])})
        else:
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]


def parse_text(fmt: str, text: str, *, parallel: bool = True) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole answer: content None when there are calls and no
    other text; calls as in OpenAI's ``message.tool_calls``."""
    parser = new_parser(fmt, parallel=parallel)
    content, deltas = parser.feed(text)
    more, more_deltas = parser.finish()
    calls: list[dict] = []
    accumulate(calls, deltas + more_deltas)
    content += more
    return (content or None) if calls else content, calls
