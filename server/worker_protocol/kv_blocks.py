"""KV-cache blocks as the wire names them: chained digests of token-id blocks. Sans-IO.

A worker whose engine reports its KV cache (vLLM's KV events, ``server.engines.vllm.events``)
tells its frontends which blocks it holds, and the frontend asks which leading blocks of a
prompt a worker holds (``server.manager.kv_index``). Both must name a block the same way,
without the engine's own block hashes (vLLM's chain starts from a seed of its process, and
its hash function is its own business): a block is named by the digest of its token ids
chained to the name of the block before it::

    d_0 = blake2b(seed + ids_0),  d_i = blake2b(d_{i-1} + ids_i)

over whole blocks of the engine's block size, ids as 8-byte little-endian integers, 8-byte
digests. Two prompts share their first k names exactly when they share their first k
blocks of ids (and their seed); the ``seed`` is what else keys an engine's cache besides the
ids: the LoRA adapter and the ``cache_salt`` (:func:`seed_of`; empty for neither).

The KV events on the wire (the note ``{"kv_events": [...]}`` of a STEP, docs/protocol.md)
are lists: ``[STORED, [digest, ...]]`` (the worker now holds those blocks),
``[REMOVED, [digest, ...]]`` (it evicted them) and ``[CLEARED]`` (it holds none: its cache
was reset, or events were lost and what it holds is unknown).
"""

from __future__ import annotations

import array
import hashlib
import sys
from typing import Container, Iterable, Sequence

__all__ = ["STORED", "REMOVED", "CLEARED", "DIGEST_BYTES", "block_digests", "leading",
           "seed_of"]

STORED = 0
REMOVED = 1
CLEARED = 2
#: Bytes of a block's digest (a collision among 2^64 names is not a concern here).
DIGEST_BYTES = 8


def seed_of(keys: Iterable[object] = ()) -> bytes:
    """The seed of a chain whose engine keys its first block with ``keys`` as well as ids
    (vLLM: the LoRA adapter's name, then the cache salt; none: ``b""``)."""
    parts = [str(k) for k in keys if k is not None]
    return b"\x00".join(p.encode("utf-8", "surrogatepass") for p in parts) + (
        b"\x01" if parts else b"")


def block_digests(ids: Sequence[int], block_size: int, seed: bytes = b"",
                  parent: bytes | None = None) -> list[bytes]:
    """The names of the whole blocks of ``ids`` (a trailing partial block has none),
    chained after ``parent`` (a block's name), or from ``seed`` for the first block of a
    prompt. O(len(ids)), in C but for one hash call per block."""
    if block_size < 1:
        raise ValueError("block_size must be positive")
    n = len(ids) // block_size
    if not n:
        return []
    data = array.array("q", ids[: n * block_size])
    if sys.byteorder != "little":
        data.byteswap()
    raw = memoryview(data).cast("B")
    step = block_size * 8
    blake = hashlib.blake2b
    prev = seed if parent is None else parent
    out = []
    for i in range(n):
        h = blake(prev, digest_size=DIGEST_BYTES)
        h.update(raw[i * step:(i + 1) * step])
        prev = h.digest()
        out.append(prev)
    return out


def leading(names: Iterable[bytes], held: Container[bytes]) -> int:
    """How many of the first ``names`` (a prompt's chained blocks) are in ``held``: the
    blocks a cache can reuse (each only after all the blocks before it)."""
    n = 0
    for name in names:
        if name not in held:
            break
        n += 1
    return n
