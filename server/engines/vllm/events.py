"""vLLM's KV cache events, for the frontend's prefix routing (docs/routing.md).

Theory of operation
-------------------
With ``kv_events_config`` on, vLLM's scheduler publishes, once per engine step, what its
KV cache manager did: blocks stored (their hashes, the hash of the block before them, their
token ids), blocks removed (evicted), all blocks cleared. Its only public publisher is a
ZMQ PUB socket, served by a thread of vLLM's (in the engine core's process: this one, or
vLLM's core process). :class:`KVEventSubscriber` gives it an ``ipc://`` endpoint in a
private directory of this worker (mode 0700, removed once connected, or at
:meth:`~KVEventSubscriber.close`),
holds the SUB socket, and :meth:`~KVEventSubscriber.drain` takes what arrived, never
blocking: the engine calls it after each step, and the events go to the frontend as the
note ``[nil, {"kv_events": [...]}]`` of that STEP (docs/protocol.md).

:class:`KVEventTranslator` (sans-IO) turns vLLM's events into the wire's: a block is named
by the chained digest of its token ids (:mod:`server.worker_protocol.kv_blocks`), which the
frontend can compute from a prompt's ids, where vLLM's own hashes it could not (their chain
starts from a seed of vLLM's). It keeps vLLM's hash -> our name for the blocks held (so
that a removal, which carries vLLM's hash only, can be named, and a frontend that connects
later can be given the whole set: :meth:`~KVEventTranslator.snapshot`).

Loss is never silent: the publisher numbers its batches; a gap (a batch dropped at ZMQ's
high-water mark, or sent before the subscription took effect) is sent as ``[CLEARED]``
followed by what is known from then on, so the frontend forgets rather than believes.
Only the device tier (``medium`` GPU or unset) of the first KV cache group is reported
(other tiers, other groups of a hybrid model: skipped), and only whole blocks.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from ...worker_protocol.kv_blocks import CLEARED, REMOVED, STORED, block_digests, seed_of

__all__ = ["KVEventSubscriber", "KVEventTranslator"]

#: The device tier's name in vLLM's events (its default ``medium``).
_DEVICE_MEDIA = (None, "GPU")


class KVEventTranslator:
    """vLLM's events -> wire events (see the module docstring)."""

    def __init__(self) -> None:
        #: vLLM's block hash -> our name, for every block held.
        self._names: dict[object, bytes] = {}
        #: The block size of the events (the first stored event's).
        self.block_size: int | None = None

    def __len__(self) -> int:
        return len(self._names)

    def snapshot(self) -> list[list]:
        """The wire events that tell a new listener everything held now."""
        if not self._names:
            return []
        return [[STORED, list(self._names.values())]]

    def clear(self) -> list[list]:
        self._names.clear()
        return [[CLEARED]]

    def translate(self, events) -> list[list]:
        """Wire events for vLLM's ``events`` (one batch's, in order)."""
        out: list[list] = []
        names = self._names
        for ev in events:
            kind = type(ev).__name__
            if kind == "AllBlocksCleared":
                out.extend(self.clear())
                continue
            if getattr(ev, "medium", None) not in _DEVICE_MEDIA or getattr(
                    ev, "group_idx", None) not in (None, 0):
                continue
            if kind == "BlockRemoved":
                gone = []
                for h in ev.block_hashes:
                    name = names.pop(h, None)
                    if name is not None:
                        gone.append(name)
                if gone:
                    out.append([REMOVED, gone])
            elif kind == "BlockStored":
                stored = self._stored(ev)
                if stored:
                    out.append([STORED, stored])
        return out

    def _stored(self, ev) -> list[bytes]:
        hashes = ev.block_hashes
        size = ev.block_size
        if not hashes or size < 1 or len(ev.token_ids) != len(hashes) * size:
            return []  # not whole blocks
        if self.block_size is None:
            self.block_size = size
        elif size != self.block_size:
            return []
        if ev.parent_block_hash is None:
            extra = ev.extra_keys[0] if ev.extra_keys else None
            digests = block_digests(ev.token_ids, size, seed_of(extra or ()))
        else:
            parent = self._names.get(ev.parent_block_hash)
            if parent is None:  # its chain is unknown here (a gap): unreachable anyway
                return []
            digests = block_digests(ev.token_ids, size, parent=parent)
        names = self._names
        new = [d for h, d in zip(hashes, digests) if h not in names]  # (not re-stores)
        names.update(zip(hashes, digests))
        return new


class KVEventSubscriber:
    """The SUB end of vLLM's ZMQ publisher, on an ``ipc://`` endpoint in a private
    directory. :meth:`engine_config` is the ``kv_events_config`` to build vLLM with; create
    this first (the socket connects once vLLM binds)."""

    def __init__(self) -> None:
        import zmq

        self._zmq = zmq
        self._dir = tempfile.mkdtemp(prefix="trio-llm-kv-")  # mode 0700
        self.endpoint = "ipc://" + os.path.join(self._dir, "events")
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        # (watched before connecting, so that the connection's event cannot be missed)
        self._monitor: Any = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED)
        self._sock.connect(self.endpoint)
        self._decoder: Any = None
        #: The next batch's number (the publisher's count starts at 0).
        self._next = 0
        self.translator = KVEventTranslator()

    def engine_config(self):
        from vllm.config.kv_events import KVEventsConfig

        return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                              endpoint=self.endpoint, topic="")

    def wait_connected(self, timeout: float) -> bool:
        """Once vLLM's publisher is bound (the engine is built): wait, at most ``timeout``
        seconds, for the connection to it, then remove the private directory (the socket
        file is no longer needed; nothing is left behind if this process is killed).
        False if it did not connect in time (the directory then goes at :meth:`close`)."""
        monitor = self._monitor
        if monitor is None:
            return True
        connected = bool(monitor.poll(int(timeout * 1000)))
        self._sock.disable_monitor()
        monitor.close(linger=0)
        self._monitor = None
        if connected:
            shutil.rmtree(self._dir, ignore_errors=True)
        return connected

    def drain(self) -> list[list]:
        """The wire events of every batch that arrived (none: ``[]``); never blocks."""
        zmq = self._zmq
        out: list[list] = []
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) != 3:
                continue
            if self._decoder is None:
                import msgspec
                from vllm.distributed.kv_events import KVEventBatch

                self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq < 0:  # the publisher's end marker
                continue
            if seq != self._next:  # lost batches: what is held is unknown
                out.extend(self.translator.clear())
            self._next = seq + 1
            try:
                batch = self._decoder.decode(frames[2])
                events = self.translator.translate(batch.events)
            except Exception:  # noqa: BLE001 - a batch not understood is a lost one
                out.extend(self.translator.clear())
                continue
            out.extend(events)

    def close(self) -> None:
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        self._sock.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
