"""The worker's side of its preparation helper process (:mod:`server.workers.prep_child`).

Example (what the transformers engine does when its worker's preparation stage starts)::

    helper = PrepHelper({"model_path": ..., "vocab_size": V, ...})
    ids = helper.encode(prompt, template_kwargs, tools)   # a preparation thread; blocks
    packed = helper.tokenize(request)                     # wire.Packed, for RESULT
    text = helper.compile(key)                            # a compiled grammar's JSON
    helper.close()                                        # kills the process

Theory of operation
-------------------
One supervising thread owns the process: it starts it (at once: the process loads the
tokenizer and xgrammar while the worker loads its model), reads its replies and hands each
to the :class:`~concurrent.futures.Future` of the request that waits for it. When the
process ends (killed, out of memory, a crash in a native library) the thread fails every
request the process held with :class:`HelperDied`, a :class:`Rejected` of kind
``engine_error`` (a 5xx that names the engine's fault; requests it did not hold are not
touched), and starts a new process after a short pause. A request sent while there is no
process waits for the next one (at most :data:`RESTART_WAIT` s). The process dies with the
worker: ``close`` kills it, its input's end ends it, and a parent-death signal kills it if
the worker is SIGKILLed. Callers are preparation threads (any number); the worker's loop
never calls this.

The replies are not decoded here beyond their head: a /tokenize answer's bytes go to the
frontend as they came (``wire.Packed``), token ids come as an int32 array (one conversion
to a list, no msgpack), a compiled grammar as its JSON.
"""

from __future__ import annotations

import array
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

import msgpack

from ..worker_protocol import wire
from .base import HFTokenizing, Rejected
from .prep_child import FAILED, HEAD, LENGTH, REJECTED

__all__ = ["HelperDied", "HelperTokenizing", "PROCESS_BYTES", "PrepHelper", "RESTART_WAIT",
           "prompt_weight"]

#: Most seconds a request waits for a (re)started helper process.
RESTART_WAIT = 30.0
#: Pause before a dead helper is started again (a helper that cannot start does not spin).
_RESTART_PAUSE = 0.5


#: A request heavier than this (characters of its prompt or messages, bytes of its
#: grammar's key) is prepared in the worker's helper process (engine option
#: ``prepare_process_bytes``); lighter ones in the worker, with no added latency.
PROCESS_BYTES = 32 * 1024


def prompt_weight(prompt, limit: int) -> int:
    """A prompt's size for the choice above: a text's length; a chat's, the lengths of its
    strings plus 64 per message (a template's work grows with both), counted until past
    ``limit``."""
    if isinstance(prompt, str):
        return len(prompt)
    total = 0
    stack = [prompt]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += 64
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


class HelperDied(Rejected):
    """The helper process ended while it held this request: an engine fault (5xx)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, kind="engine_error")


class PrepHelper:
    """See the module docstring. ``config``: what :func:`prep_child.main` reads."""

    def __init__(self, config: dict) -> None:
        self._config = {**config, "parent": os.getpid()}
        self._cond = threading.Condition()
        self._write_lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._pending: dict[int, Future] = {}
        self._seq = itertools.count()
        self._closed = False
        self.restarts = 0
        self._thread = threading.Thread(target=self._supervise, name="prepare-helper",
                                        daemon=True)
        self._thread.start()

    def pid(self) -> int | None:
        """The helper process's pid (None between processes)."""
        with self._cond:
            return None if self._proc is None else self._proc.pid

    def statistics(self) -> dict:
        with self._cond:
            return {"pid": None if self._proc is None else self._proc.pid,
                    "pending": len(self._pending), "restarts": self.restarts}

    def wait_started(self) -> None:
        """Block until the process answers (it has loaded the tokenizer and xgrammar)."""
        self._call("ping", None)

    def encode(self, prompt, template_kwargs, tools) -> list[int]:
        ids = array.array("i")
        ids.frombytes(self._call("encode", [prompt, template_kwargs, tools]))
        return ids.tolist()

    def tokenize(self, request: dict) -> wire.Packed:
        return wire.Packed(self._call("tokenize", request))

    def compile(self, key: str) -> str:
        return self._call("compile", key).decode()

    def close(self) -> None:
        """Kill the process and wait for it (bounded); requests it held fail."""
        with self._cond:
            self._closed = True
            proc = self._proc
            self._cond.notify_all()
        if proc is not None:
            proc.kill()
        self._thread.join(10.0)

    def _call(self, op: str, arg) -> bytes:
        """Send one request and wait for its payload (a preparation thread)."""
        body = msgpack.packb([0, op, arg], use_bin_type=True)[2:]  # seq spliced in below
        future: Future = Future()
        with self._cond:
            if not self._cond.wait_for(lambda: self._proc is not None or self._closed,
                                       RESTART_WAIT) or self._closed:
                raise HelperDied("the engine's preparation process is not running")
            proc = self._proc
            assert proc is not None and proc.stdin is not None
            seq = next(self._seq)
            self._pending[seq] = future
        frame = b"\x93" + msgpack.packb(seq) + body
        try:
            with self._write_lock:
                proc.stdin.write(LENGTH.pack(len(frame)) + frame)
                proc.stdin.flush()
        except (OSError, ValueError):  # it died: the supervising thread fails the future
            pass
        status, payload = future.result()
        if status == REJECTED:
            kind, message, param = msgpack.unpackb(payload, raw=False)
            raise Rejected(message, kind, param)
        if status == FAILED:
            raise Rejected(f"the engine could not prepare this request: "
                           f"{payload.decode(errors='replace')}", "engine_error")
        return payload

    def _supervise(self) -> None:
        argv = [sys.executable, "-m", "server.workers.prep_child", json.dumps(self._config)]
        while True:
            with self._cond:
                if self._closed:
                    return
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    close_fds=True)
            with self._cond:
                self._proc = proc
                self._cond.notify_all()
                if self._closed:
                    proc.kill()
            self._read(proc)
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()  # type: ignore[union-attr]
                except OSError:
                    pass
            with self._cond:
                self._proc = None
                held, self._pending = self._pending, {}
                closed = self._closed
                if not closed:
                    self.restarts += 1
            for future in held.values():
                future.set_exception(HelperDied(
                    f"the engine's preparation process died (exit status {proc.returncode}) "
                    "while it held this request; it was restarted"))
            if closed:
                return
            print(f"trio-llm-server worker: preparation process {proc.pid} exited with "
                  f"{proc.returncode}; restarting it", file=sys.stderr)
            time.sleep(_RESTART_PAUSE)

    def _read(self, proc: subprocess.Popen) -> None:
        """Route replies to their futures until the process's output ends."""
        stdout = proc.stdout
        assert stdout is not None
        while True:
            head = stdout.read(LENGTH.size)
            if len(head) < LENGTH.size:
                return
            size = LENGTH.unpack(head)[0]
            body = stdout.read(size)
            if len(body) < size or size < HEAD.size:
                return
            seq, status = HEAD.unpack_from(body)
            with self._cond:
                future = self._pending.pop(seq, None)
            if future is not None:
                future.set_result((status, body[HEAD.size:]))


#: Text the helper's tokenizer must encode as the worker's: spaces, a newline and a tab,
#: digits, accents, CJK, an emoji and markup (and, appended, the special tokens' texts).
PROBE_TEXT = " Hello,  world!\n\t123 café 日本語 naïve 🙂 <b>x</b> "


class HelperTokenizing(HFTokenizing):
    """Tokenizing for an engine with a preparation helper process (transformers, vllm):
    :meth:`encode_prompt` and :meth:`tokenize` send a prompt heavier than
    ``prepare_process_bytes`` to the helper, while it runs. The worker's preparation stage
    (:class:`server.workers.prepare.Preparer`) calls :meth:`start_helper` when it starts and
    :meth:`stop_helper` when it ends; an engine used without one prepares everything in the
    calling thread. The engine calls :meth:`helper_options` in its constructor and gives
    the helper's configuration in :meth:`helper_config` (None: no helper, e.g. a tokenizer
    the helper could not load as the engine did)."""

    _helper: PrepHelper | None = None
    #: None: no helper (``prepare_process`` off)
    _process_bytes: int | None = None
    _process_nice: int = 10

    def helper_options(self, enabled: bool, size: int, nice: int) -> None:
        """The ``prepare_process*`` engine options, checked."""
        if size < 0 or not 0 <= nice <= 19:
            raise ValueError("prepare_process_bytes must be at least 0 and "
                             "prepare_process_nice between 0 and 19")
        self._process_bytes = size if enabled else None
        self._process_nice = nice

    def helper_config(self) -> dict | None:
        """What :func:`server.workers.prep_child.main` reads, less ``nice``; None: none."""
        return None

    def start_helper(self) -> None:
        """Start the preparation helper process (when ``prepare_process`` is on)."""
        if self._process_bytes is None or self._helper is not None:
            return
        config = self.helper_config()
        if config is not None:
            self._helper = PrepHelper({**config, "nice": self._process_nice,
                                       "probe": self.helper_probes()})

    def helper_probes(self) -> list:
        """Prompts and the ids this engine makes of them: the helper loads its tokenizer
        without torch only where it makes the same (:mod:`server.workers.prep_child`)."""
        specials = " ".join(getattr(self.tokenizer, "all_special_tokens", None) or ())
        prompts: list = [PROBE_TEXT, f"{PROBE_TEXT} {specials}"]
        if self.chat_template is not None:
            prompts.append({"messages": [{"role": "user", "content": PROBE_TEXT}]})
        probes = []
        for prompt in prompts:
            try:
                probes.append([prompt, self.encode(prompt)])
            except Exception:  # (a template that refuses this conversation: not a probe)
                continue
        return probes

    def stop_helper(self) -> None:
        helper, self._helper = self._helper, None
        if helper is not None:
            helper.close()

    def _helper_for(self, prompt) -> PrepHelper | None:
        """The helper process, when it runs and ``prompt`` is heavy enough for it."""
        helper, limit = self._helper, self._process_bytes
        if helper is None or limit is None or prompt is None or isinstance(prompt, list):
            return None
        return helper if prompt_weight(prompt, limit) > limit else None

    def encode_prompt(self, prompt: object, template_kwargs: dict | None = None,
                      tools: list | None = None) -> list[int]:
        """:meth:`encode`, in the helper process when the prompt is heavy (a preparation
        thread waits for it)."""
        helper = self._helper_for(prompt)
        if helper is not None:
            return helper.encode(prompt, template_kwargs, tools)
        return self.encode(prompt, template_kwargs, tools)

    def tokenize(self, request: dict):  # type: ignore[override]
        """/tokenize and /detokenize; a heavy one in the helper process (its answer comes
        packed: ``wire.Packed``)."""
        if request.get("op") == "tokenize":
            helper = self._helper_for(request.get("prompt"))
            if helper is not None:
                return helper.tokenize(request)
        return super().tokenize(request)
