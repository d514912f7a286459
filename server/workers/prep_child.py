"""The preparation helper process of a transformers worker: heavy preparation, own GIL.

Started by :class:`server.workers.prep_helper.PrepHelper` as ``python -m
server.workers.prep_child '<json config>'``, with pipes as stdin and stdout. It loads the
model's tokenizer (not the model; without torch where it can), lowers its own priority
(``nice``, 10 unless configured: the whole process, so no thread of the worker ever waits
on it for the GIL, which is what made niced threads stall the loop) and answers requests
until its input ends.

Why a process: a preparation thread releases the GIL for the Rust tokenizer and
xgrammar's compiler, but on a contended core it still takes half of the core's time from
the worker's step loop, and pure-Python work (a chat template of 20,000 messages) shares
the GIL with it. Here, that work runs at a lower priority and with its own GIL.

Frames, both ways: a 4-byte big-endian length, then the body. A request's body is msgpack
``[seq, op, arg]``; a reply's is ``seq`` (8 bytes), a status byte and the payload:

==========  ================================  =========================================
op          arg                               payload when the status is OK (0)
==========  ================================  =========================================
tokenize    a CALL request (dict)         the result's msgpack (wire.pack_sliced)
encode      [prompt, template_kwargs, tools]  the prompt's ids, int32 native order
compile     a grammar key (grammar.py)        the compiled grammar's JSON (xgrammar)
ping        nil                               nothing (the process is ready)
==========  ================================  =========================================

Status 1 (REJECTED): the payload is msgpack ``[kind, message, param]``, a client fault; status
2 (FAILED): the payload is a UTF-8 line. Each request runs in a thread of its own (at most
as many as the worker's preparation and compile threads send at once); replies come in
the order they finish.
"""

from __future__ import annotations

import array
import ctypes
import gc
import json
import os
import signal
import struct
import sys
import threading

import msgpack

from .base import HFTokenizing, Rejected, one_line

__all__ = ["OK", "REJECTED", "FAILED", "HEAD", "LENGTH", "main"]

OK, REJECTED, FAILED = 0, 1, 2
LENGTH = struct.Struct(">I")
#: A reply's head after its length: the request's seq and the status.
HEAD = struct.Struct(">QB")
_PR_SET_PDEATHSIG = 1


class _Tokenizing(HFTokenizing):
    """The worker engine's tokenizing, with the same tokenizer and limits."""

    def __init__(self, tokenizer, config: dict) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = config["vocab_size"]
        template = getattr(tokenizer, "chat_template", None)
        self.chat_template = template if isinstance(template, str) and template else None
        self.info = {"model": config["model"]}
        self.max_model_len = config["max_model_len"]


def _tokenizing(config: dict) -> _Tokenizing:
    """The worker's tokenizing here. Loaded without torch where the tokenizer allows
    (:func:`~server.engines.transformers.text.load_tokenizer_light`) and it encodes the
    worker's probes (``config["probe"]``: prompts and the ids the worker made of them) as
    the worker does; else as the worker loads it (AutoTokenizer, which imports torch)."""
    from ..engines.transformers.text import load_tokenizer, load_tokenizer_light

    probes = config.get("probe") or []
    light = load_tokenizer_light(config["model_path"]) if probes else None
    if light is not None:
        tok = _Tokenizing(light, config)
        try:
            if all(tok.encode(prompt) == ids for prompt, ids in probes):
                return tok
        except Exception:  # (a template this class renders otherwise: the worker's way)
            pass
    return _Tokenizing(load_tokenizer(config["model_path"]), config)


def _answer(tok: _Tokenizing, grammars, op: str, arg) -> bytes:
    from ..worker_protocol import wire

    if op == "ping":  # started: the tokenizer is loaded
        return b""
    if op == "tokenize":
        return wire.pack_sliced(tok.tokenize(arg)).data
    if op == "encode":
        prompt, template_kwargs, tools = arg
        return array.array("i", tok.encode(prompt, template_kwargs, tools)).tobytes()
    if op == "compile":
        if grammars is None:
            raise Rejected("response_format needs xgrammar, which is not installed")
        return grammars.compile_here(arg).serialize_json().encode()
    raise ValueError(f"unknown operation {op!r}")


def _serve(tok, grammars, fd_out: int, seq: int, op: str, arg, lock: threading.Lock) -> None:
    try:
        status, payload = OK, _answer(tok, grammars, op, arg)
    except Rejected as exc:
        status, payload = REJECTED, msgpack.packb([exc.kind, exc.message, exc.param])
    except Exception as exc:
        status, payload = FAILED, one_line(exc).encode()
    head = LENGTH.pack(HEAD.size + len(payload)) + HEAD.pack(seq, status)
    with lock:
        _write_all(fd_out, head)
        _write_all(fd_out, payload)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(stream, n: int) -> bytes | None:
    data = stream.read(n)
    return data if data is not None and len(data) == n else None


def main(argv: list[str]) -> None:
    config = json.loads(argv[0])
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # the worker died, even of SIGKILL
    if os.getppid() != config["parent"]:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker decides when this ends
    try:
        os.nice(config.get("nice", 10))
    except OSError:  # a sandbox that forbids it: the same priority
        pass
    fd_out = os.dup(1)
    os.dup2(2, 1)  # a stray print goes to stderr, not into a reply
    tok = _tokenizing(config)
    grammars = None
    if config.get("grammar") is not None:  # (the worker's remote compiles: xgrammar, torch)
        from ..engines.transformers.grammar import Grammars

        grammars = Grammars(tok.tokenizer, vocab_size=config["vocab_size"],
                            stop_ids=config["stop_ids"], **config["grammar"])
    # As the worker (main.freeze_startup_heap): full collections then walk only what the
    # requests made, not the tokenizer's and the grammar library's objects.
    gc.collect()
    gc.freeze()
    lock = threading.Lock()
    stdin = sys.stdin.buffer
    while True:
        head = _read_exactly(stdin, LENGTH.size)
        if head is None:
            return  # the worker closed the pipe, or died
        body = _read_exactly(stdin, LENGTH.unpack(head)[0])
        if body is None:
            return
        seq, op, arg = msgpack.unpackb(body, raw=False)
        threading.Thread(target=_serve, args=(tok, grammars, fd_out, seq, op, arg, lock),
                         daemon=True).start()


if __name__ == "__main__":
    main(sys.argv[1:])
