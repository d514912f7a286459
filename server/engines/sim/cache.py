"""The sim engine's prefix cache: a model of vLLM's automatic prefix caching. Sans-IO.

A prompt's tokens are cut into blocks of ``block_size``; each full block is named by a
chained hash (of its parent block's hash and its tokens), so a block is only found when
every block before it is too. The cache holds at most ``capacity_tokens // block_size``
blocks and evicts the least recently used first. As in vLLM:

* only full blocks are cached, and at most ``prompt_tokens - 1`` tokens count as cached (the
  last prompt token is always computed, to sample the first output token): a prompt that
  is all cached blocks reuses all but its last block;
* a request's blocks are cached once it is scheduled (admitted), so a later request with the
  same prefix hits them even while the first is still running.

Unlike vLLM, blocks of running requests may be evicted (the sim holds no KV memory).
"""

from __future__ import annotations

import collections
from typing import Sequence

__all__ = ["PrefixCache"]


class PrefixCache:
    def __init__(self, capacity_tokens: int, block_size: int = 16) -> None:
        if capacity_tokens < 0 or block_size < 1:
            raise ValueError("the sim's prefix cache needs capacity_tokens >= 0 and "
                             "block_size >= 1")
        self.block_size = block_size
        self.capacity = capacity_tokens // block_size
        self._blocks: collections.OrderedDict[int, None] = collections.OrderedDict()
        #: Totals, for statistics: prompt tokens looked up, and found cached.
        self.queried = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def hashes(self, tokens: Sequence, adapter: str | None = None) -> list[int]:
        """The chained hashes of the full blocks of ``tokens`` (hashable items); a LoRA
        ``adapter``'s blocks are its own (vLLM keys them by its name)."""
        size = self.block_size
        out = []
        parent = 0 if adapter is None else hash(("lora", adapter))
        for i in range(len(tokens) // size):
            parent = hash((parent, tuple(tokens[i * size : (i + 1) * size])))
            out.append(parent)
        return out

    def admit(self, hashes: list[int], prompt_tokens: int) -> int:
        """Schedule a prompt of ``prompt_tokens`` whose full blocks are ``hashes``: returns
        the tokens found cached, then caches its blocks (most recently used)."""
        blocks = self._blocks
        usable = max(0, (prompt_tokens - 1) // self.block_size)
        hit = 0
        for h in hashes[:usable]:
            if h not in blocks:
                break
            hit += 1
        cached = hit * self.block_size
        self.queried += prompt_tokens
        self.hits += cached
        if self.capacity:
            for h in hashes:
                if h in blocks:
                    blocks.move_to_end(h)
                else:
                    blocks[h] = None
            while len(blocks) > self.capacity:
                blocks.popitem(last=False)
        return cached
