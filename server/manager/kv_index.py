"""What a worker's KV cache holds, exactly, from the worker's KV events. Sans-IO.

Theory of operation
-------------------
A worker whose engine reports its KV cache (the vllm engine with prefix caching: its HELLO
says ``"kv_events": {"block_size": B}``) sends, with each engine step, the blocks its cache
stored and removed (the note ``[nil, {"kv_events": [...]}]`` of a STEP). A listening worker
sends every frontend the same, and a frontend that connects gets the blocks held then.
A block is named by the chained digest of its token ids
(:mod:`server.worker_protocol.kv_blocks`), so a :class:`KVIndex` is a set of names: the
blocks the worker holds, as of the last frame the frontend read. A prompt's token ids, cut
into blocks of B and named the same way, match the worker's cache as far as their leading
names are in the set (the engine reuses a block only after all the blocks before it).

Exact up to the frames in flight: a block stored by a step the frontend has not read yet
is not seen (a request just sent is counted by the router's load instead), and one evicted
meanwhile still counts. The index starts empty with each session (a restarted worker's
cache is empty; a reconnected one sends what it holds) and is bounded: a worker that names
more than ``capacity`` blocks is forgotten (cleared), not believed.

:func:`prefix_tokens` scores a token-id prompt on every worker: exactly where the worker
reports its cache, else as predicted (the router's :class:`~server.manager.routing.PrefixIndex`).
"""

from __future__ import annotations

from typing import Sequence

from ..worker_protocol.kv_blocks import CLEARED, REMOVED, STORED, block_digests, leading
from ..worker_protocol.messages import KvEvent

__all__ = ["KVIndex", "DEFAULT_CAPACITY", "prefix_tokens"]

#: Blocks an index holds at most (16 M tokens of blocks of 16; some 100 bytes a block).
DEFAULT_CAPACITY = 1 << 20


class KVIndex:
    """The blocks one worker's KV cache holds (see the module docstring)."""

    __slots__ = ("block_size", "capacity", "_held", "events")

    def __init__(self, block_size: int, capacity: int = DEFAULT_CAPACITY,
                 events: list[int] | None = None) -> None:
        if block_size < 1 or capacity < 1:
            raise ValueError("a KV index needs a block size and a capacity of at least 1")
        self.block_size = block_size
        self.capacity = capacity
        self._held: set[bytes] = set()
        #: Events applied (stored, removed, cleared), for the metrics: ``events`` (a
        #: worker's count over its sessions) or a new count.
        self.events = [0, 0, 0] if events is None else events

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, name: bytes) -> bool:
        return name in self._held

    def apply(self, events: Sequence[KvEvent]) -> None:
        """A STEP's ``kv_events``, in order."""
        held = self._held
        counts = self.events
        for event in events:
            kind = event.kind
            if kind == STORED:
                held.update(event.digests)  # type: ignore[arg-type]
                if len(held) > self.capacity:
                    held.clear()
            elif kind == REMOVED:
                held.difference_update(event.digests)  # type: ignore[arg-type]
            elif kind == CLEARED:
                held.clear()
            counts[kind] += 1

    def clear(self) -> None:
        self._held.clear()

    def match(self, names: Sequence[bytes]) -> int:
        """How many leading ``names`` (a prompt's blocks) the worker holds."""
        return leading(names, self._held)


def prefix_tokens(
    ids: Sequence[int], seed: bytes, exact: Sequence[KVIndex | None],
    predicted: Sequence[int],
) -> list[int]:
    """Per worker, how many leading tokens of the prompt ``ids`` (keyed by ``seed``:
    :func:`~server.worker_protocol.kv_blocks.seed_of` of its adapter and cache salt) it
    holds: ``exact[i]``'s match where worker i reports its cache, else ``predicted[i]``
    (tokens). Each block size's names are computed once."""
    names: dict[int, list[bytes]] = {}
    out = []
    for i, index in enumerate(exact):
        if index is None:
            out.append(predicted[i])
            continue
        size = index.block_size
        blocks = names.get(size)
        if blocks is None:
            try:
                blocks = names[size] = block_digests(ids, size, seed)
            except (OverflowError, TypeError):  # ids no engine takes: no prefix
                blocks = names[size] = []
        out.append(index.match(blocks) * size)
    return out
