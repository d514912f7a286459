"""The worker's pulse while a LoRA adapter loads (server.workers.pulse, handle_in_pulse).

A load answered on the worker's loop may wait without computing: on a slow disk, or on
vLLM's engine core process, which does the loading with ``--engine-core process`` (vLLM's
``SyncMPClient.add_lora`` blocks on a future). The pulse speaks for such a wait, for at most
``LORA_WAIT`` seconds; a step or another answer that waits without computing stays silent
(a deadlock is not progress).

The sim engine serves no adapters, so the engine here is a stand-in for vLLM's: its
``load_lora`` waits (no CPU in the loop's thread, like ``future.result()``) until the pulse
has spoken, the loop's thread being this test's. Plain threads, no trio: the loop is.
"""

from __future__ import annotations

import threading
import time

from server.workers import main as worker_main
from server.workers.main import handle_in_pulse
from server.workers.pulse import Pulse
from server.worker_protocol import wire

#: The pulse's period here (seconds).
PERIOD = 0.02


class _Spoken:
    """The pulse's ``send``: counts the unasked PONGs; ``enough`` is set at ``times``."""

    def __init__(self, times: int) -> None:
        self.count = 0
        self.times = times
        self.enough = threading.Event()

    def __call__(self) -> None:
        self.count += 1
        if self.count >= self.times:
            self.enough.set()


class _WaitingEngine:
    """A stand-in for the vllm engine with adapters, whose ``load_lora`` calls ``wait()``
    (blocking without computing) and says in its answer what that returned."""

    info = {"engine": "stand-in", "lora": {"max_loras": 1}}

    def __init__(self, wait) -> None:
        self._wait = wait

    def load_lora(self, name, path) -> dict:
        return {"name": name, "path": path, "loaded": bool(self._wait())}


def _load(pulse: Pulse, engine) -> list | None:
    """A load_lora CALL answered on this thread, the loop's, with ``pulse`` running."""
    pulse.start()
    try:
        return handle_in_pulse(
            pulse, engine, [wire.CALL, 7, {"op": "load_lora", "name": "a", "path": "/a"}],
            [], [], None)
    finally:
        pulse.close()


def test_the_pulse_speaks_while_a_lora_load_waits_without_computing():
    spoken = _Spoken(times=3)
    pulse = Pulse(spoken, PERIOD)
    # (the guard: without the pulse's word the wait would end only there)
    reply = _load(pulse, _WaitingEngine(lambda: spoken.enough.wait(60)))
    assert reply == [wire.RESULT, 7, {"name": "a", "path": "/a", "loaded": True}, None]


def test_the_pulse_speaks_for_a_waiting_load_for_lora_wait_seconds_only(monkeypatch):
    monkeypatch.setattr(worker_main, "LORA_WAIT", 5 * PERIOD)
    spoken = _Spoken(times=10**9)
    pulse = Pulse(spoken, PERIOD)
    reply = _load(pulse, _WaitingEngine(lambda: time.sleep(30 * PERIOD) or True))
    assert reply is not None and reply[3] is None
    # a tick at most every PERIOD, and those past LORA_WAIT silent (one may find CPU used
    # before the wait began)
    assert spoken.count <= 5 + 1


def test_the_pulse_stays_silent_while_another_answer_waits_without_computing():
    """A tokenize waiting without computing (not a LoRA op) is not spoken for: a loop
    blocked on a lock or a peer that never answers is hung."""
    spoken = _Spoken(times=10**9)
    pulse = Pulse(spoken, PERIOD)

    class _Tokenizer:
        info = {"engine": "stand-in"}

        def tokenize(self, request):
            time.sleep(30 * PERIOD)
            return {"tokens": [1], "count": 1, "max_model_len": 8}

    pulse.start()
    try:
        reply = handle_in_pulse(pulse, _Tokenizer(),
                                [wire.CALL, 3, {"op": "tokenize", "prompt": "x"}], [], [], None)
    finally:
        pulse.close()
    assert reply is not None and reply[1] == 3
    assert spoken.count <= 1  # (the first tick may find CPU used before the wait began)
