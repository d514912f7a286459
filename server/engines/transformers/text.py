"""Token ids to client text for one request: incremental detokenization, then stop strings.

Example::

    text = RequestText(backend_tokenizer, prompt_ids, stop=("\\n\\n",))
    delta, stopped = text.feed(token_id)        # text safe to send now, and whether to stop
    delta, stopped = text.finish()              # at EOS or max_tokens: what was held back

Detokenization uses :class:`tokenizers.decoders.DecodeStream`, which decodes a window of the
latest ids and only returns text once it is valid UTF-8: a character that spans tokens (a
CJK character or an emoji split into byte tokens) comes out whole, with the token that
completes it. It is seeded with the tail of the prompt, so tokenizers whose decoders treat
the first token specially (SentencePiece's leading space) produce the text as it reads after
the prompt. Each token costs one decode of a few ids: never the whole sequence.

Stop strings are matched on the detokenized text, so they are found across token
boundaries. Text that could be the start of a stop string is held back until it is decided;
the stop string and anything after it are never sent. At the end (``finish``), whatever the
stream still holds (bytes that never became a valid character, which decode as U+FFFD) and
the held-back text are sent, so the concatenated deltas equal a full decode of the ids.

Pure Python over a ``tokenizers.Tokenizer``; no torch here.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from ...workers.base import one_line
from ...workers.stops import StopMatcher

__all__ = ["RequestText", "PROMPT_CONTEXT", "load_tokenizer", "load_tokenizer_light"]

#: How many prompt ids seed the decode stream (enough for any decoder's lookbehind).
PROMPT_CONTEXT = 4


class RequestText:
    """The text side of one request: see the module docstring."""

    __slots__ = ("_tok", "_stream", "_context", "_ids", "_decoded", "stop", "_stops")

    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = ()) -> None:
        self._tok = tokenizer
        self._context = list(prompt_ids[-PROMPT_CONTEXT:])
        self._stream = _decode_stream(tokenizer, self._context)
        self._ids: list[int] = []
        self._decoded = 0  # characters the decode stream has produced so far
        self.stop = stop
        self._stops = StopMatcher(stop)

    def feed(self, token_id: int) -> tuple[str, bool]:
        """Add a generated token; returns (text to send, stop string found)."""
        self._ids.append(token_id)
        piece = self._stream.step(self._tok, token_id)
        if piece is None:
            return "", False
        self._decoded += len(piece)
        if not self.stop:
            return piece, False
        return self._stops.feed(piece)

    def finish(self) -> tuple[str, bool]:
        """The request ends (EOS or max_tokens): returns (everything not yet sent, stop string
        found in what the decode stream still held)."""
        tail = self._flush_stream()
        if self.stop and tail:
            text, stopped = self._stops.feed(tail)
            if stopped:
                return text, True
        else:
            text = tail
        return text + self._stops.flush(), False

    # -- internals --------------------------------------------------------------------------

    def _flush_stream(self) -> str:
        """Text of ids the decode stream still holds (incomplete UTF-8 decodes as U+FFFD)."""
        if not self._ids:
            return ""
        tok = self._tok
        base = tok.decode(self._context, skip_special_tokens=True) if self._context else ""
        full = tok.decode(self._context + self._ids, skip_special_tokens=True)
        if not full.startswith(base):
            return ""
        full = full[len(base) :]
        return full[self._decoded :] if len(full) > self._decoded else ""


def _decode_stream(tokenizer, context: list[int]) -> DecodeStream:
    """A DecodeStream that has seen ``context`` (older tokenizers releases take no ``ids=``)."""
    try:
        return DecodeStream(ids=context, skip_special_tokens=True)
    except TypeError:
        stream = DecodeStream(skip_special_tokens=True)
        for token_id in context:
            stream.step(tokenizer, token_id)
        return stream


def load_tokenizer_light(path):
    """:func:`load_tokenizer`'s tokenizer where it can be had without importing torch, else
    None. AutoTokenizer reads the model's config first, and that module imports torch:
    11-16 s of CPU and ~250 MB for a process that only tokenizes (the preparation helper,
    :mod:`server.workers.prep_child`). Here the class that ``tokenizer_config.json`` names
    is taken from transformers directly. None when the file names no such class, it is not
    a fast tokenizer, or it does not load. The caller must check that it tokenizes as
    :func:`load_tokenizer`'s does (AutoTokenizer may choose otherwise)."""
    import json
    from pathlib import Path

    try:
        name = json.loads((Path(path) / "tokenizer_config.json").read_text()).get(
            "tokenizer_class")
        if not isinstance(name, str) or not name.isidentifier():
            return None
        import transformers

        cls = getattr(transformers, name, None)
        if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerFast)):
            return None
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        tokenizer = cls.from_pretrained(path, local_files_only=True)
    except Exception:  # (AutoTokenizer then says what is wrong)
        return None
    return tokenizer if getattr(tokenizer, "backend_tokenizer", None) is not None else None


def load_tokenizer(path):
    """The fast tokenizer of a local model directory, offline: the worker's, and its
    preparation helper's (:mod:`server.workers.prep_child`, which loads no model)."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise RuntimeError(f"cannot load the tokenizer in {path}: {one_line(exc)}") from None
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise RuntimeError(f"{path} has no fast tokenizer (tokenizer.json), which is required")
    return tokenizer
