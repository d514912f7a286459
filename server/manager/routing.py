"""Which worker a request goes to: prefix-aware, least-loaded or round-robin. Sans-IO.

Theory of operation
-------------------
A multi-turn chat or an agent loop resends the whole conversation each turn; only the
worker that served the previous turn holds its prefix in its KV cache. The frontend does
not see the workers' caches, so it *predicts* them from what it routed (see
docs/routing.md):

* A prompt is cut into fixed-size blocks and each block is named by a chained hash
  (``h_i = H(h_{i-1}, block_i)``, as vLLM names its KV blocks), so two prompts share the
  first k block hashes exactly when they share their first k blocks. A list of token ids is
  cut into blocks of :data:`BLOCK_TOKENS` ids; a text prompt (the frontend has no token ids)
  into blocks of ``block_chars`` characters. A chat prompt is first written in a canonical
  form, which a later turn extends: its other fields as JSON, then each message as one line
  of JSON with sorted keys (an image part as its SHA-256, not its bytes). Only full
  blocks count.
* Each worker has a :class:`PrefixIndex`: the block hashes it was sent, in LRU order,
  bounded (``capacity`` blocks; the oldest are forgotten first, as the engine's own LRU
  evicts them).
* :meth:`Router.pick` scores every candidate worker by its matched prefix (leading blocks
  found in its index: O(prompt blocks) per worker). The best match wins, ties going to the
  least loaded, unless its load exceeds the least loaded worker's by more than
  ``balance``: then the least loaded worker takes it (``balance`` is the trade-off knob; 0
  is pure least-loaded where loads differ). A worker's load is its outstanding requests
  (other frontends' included) plus how many of this router's last ``window`` decisions
  (32 per worker) went to it.
* Several frontends sharing a worker tell each other, through it, what they sent it (a
  *routed notice*: the prompt's block names): :meth:`Router.noticed` inserts them as if
  this router had routed the prompt itself.
* Corrections: a worker that restarted (or reconnected) has an empty cache, so its index is
  cleared (:meth:`Router.reset`). When a result reports ``cached_tokens`` and the worker
  had less of the prompt than predicted, it evicted faster than the index assumed: the
  index forgets as many of its oldest blocks as were mispredicted (:meth:`Router.observed`).

The decision is exposed as a plain function of the prompt's blocks and the candidates'
loads, with workers to ``exclude``, so that other callers (re-dispatch after a worker dies)
can reuse it.
"""

from __future__ import annotations

import array
import collections
import hashlib
import itertools
import json
import sys
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from ..worker_protocol.kv_blocks import leading

__all__ = [
    "POLICIES", "BLOCK_CHARS", "BLOCK_TOKENS", "DEFAULT_BALANCE", "Blocks", "Decision",
    "PrefixIndex", "Router", "RouterStatistics", "canonical_text",
    "prompt_blocks",
]

#: The routing policies (``--routing``).
POLICIES = ("prefix", "least-loaded", "round-robin")
#: Characters per block of a text or chat prompt (about 64 tokens of English).
BLOCK_CHARS = 256
#: Token ids per block of a token-id prompt (vLLM's default block size).
BLOCK_TOKENS = 16
#: The version of the block naming (:func:`prompt_blocks`, :meth:`Router.blocks`: block
#: sizes, digests, seeds): frontends share routed notices only within one naming
#: (server.worker_protocol.wire.routed_topic). Bump it with any change to the names.
NAMING = 1
#: Blocks each worker's index remembers by default (about 1 M tokens of text).
DEFAULT_CAPACITY = 16384
#: Decisions remembered for the load, per worker (see :meth:`Router.pick`).
DEFAULT_WINDOW_PER_WORKER = 32
#: The default of ``balance``: extra outstanding requests the best-matching worker may
#: carry over the least loaded one (see docs/routing.md for how it was chosen).
DEFAULT_BALANCE = 8


def _chain(parts, seed: bytes = b"") -> list[bytes]:
    hashes = []
    parent = seed
    for part in parts:
        parent = hashlib.blake2b(parent + part, digest_size=8).digest()
        hashes.append(parent)
    return hashes


def canonical_text(prompt: object) -> str | None:
    """A text or chat prompt's text as blocks are cut from it (None for token ids)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        head = {k: v for k, v in prompt.items() if k != "messages"}
        lines = [json.dumps(head, sort_keys=True, separators=(",", ":"), default=str)]
        for m in prompt.get("messages") or ():
            lines.append(json.dumps(_by_digest(m), sort_keys=True, separators=(",", ":"),
                                    default=str))
        return "\n".join(lines) + "\n"
    return None


def _by_digest(message: object) -> object:
    """A message with each image part's bytes left out: the image is named by its
    SHA-256, so that the same image routes alike (and no bytes are copied into text)."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    content = message["content"]
    parts = [{"type": "image", "sha256": p.get("sha256")}
             if isinstance(p, dict) and p.get("type") == "image" else p for p in content]
    return {**message, "content": parts}


class Blocks(NamedTuple):
    """A prompt cut into blocks: the chained ``hashes`` of its full blocks, its length in
    ``units`` (characters, or token ids) and the block ``size`` in those units."""

    hashes: list[bytes]
    units: int
    size: int


def prompt_blocks(prompt: object, block_chars: int = BLOCK_CHARS, seed: bytes = b"") -> Blocks:
    """The prompt's :class:`Blocks` (see the module docstring); the chain starts from
    ``seed``: what else keys the engine's cache (the LoRA adapter and the cache salt,
    :func:`~server.worker_protocol.kv_blocks.seed_of`), so that prompts of other keys share
    no blocks."""
    text = canonical_text(prompt)
    if text is not None:
        data = text.encode("utf-8", "surrogatepass")
        n = len(text) // block_chars
        if len(data) == len(text):  # ASCII: characters are bytes
            hashes = _chain(
                (data[i * block_chars : (i + 1) * block_chars] for i in range(n)), seed)
        else:
            hashes = _chain(
                (text[i * block_chars : (i + 1) * block_chars].encode("utf-8", "surrogatepass")
                 for i in range(n)), seed)
        return Blocks(hashes, len(text), block_chars)
    if isinstance(prompt, list):
        # Each id as 8 little-endian signed bytes, converted in C (an id at a time in
        # Python took 4.5 s of the event loop for a million ids).
        n = len(prompt) // BLOCK_TOKENS
        ids = array.array("q", prompt[: n * BLOCK_TOKENS])
        if sys.byteorder != "little":
            ids.byteswap()
        raw = memoryview(ids).cast("B")
        step = BLOCK_TOKENS * 8
        hashes = _chain((raw[i * step : (i + 1) * step] for i in range(n)), seed)
        return Blocks(hashes, len(prompt), BLOCK_TOKENS)
    return Blocks([], 0, 1)


class PrefixIndex:
    """The block hashes one worker is believed to hold, in LRU order, at most ``capacity``."""

    __slots__ = ("capacity", "_blocks")

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("a prefix index needs a capacity of at least one block")
        self.capacity = capacity
        self._blocks: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: bytes) -> bool:
        return block in self._blocks

    def match(self, blocks: Sequence[bytes]) -> int:
        """How many leading ``blocks`` the worker holds (chained hashes: a block is only
        reusable after all the blocks before it)."""
        return leading(blocks, self._blocks)

    def insert(self, blocks: Sequence[bytes]) -> None:
        """The worker was sent these blocks: they are now its most recently used."""
        held = self._blocks
        for b in blocks:
            if b in held:
                held.move_to_end(b)
            else:
                held[b] = None
        while len(held) > self.capacity:
            held.popitem(last=False)

    def forget_oldest(self, n: int) -> None:
        held = self._blocks
        for _ in range(min(n, len(held))):
            held.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


class Decision(NamedTuple):
    """Where a request goes: ``worker`` (its index); ``reason`` is ``prefix`` (its best
    match won), ``load`` (no worker held any of it, or the policy is not prefix) or
    ``balance`` (the best match was too loaded); ``matched`` blocks predicted cached."""

    worker: int
    reason: str
    matched: int


@dataclass
class RouterStatistics:
    #: Decisions by reason (see :class:`Decision`).
    decisions: dict[str, int]
    #: Per worker: prompt tokens and cached prompt tokens, as results reported them
    #: (only results that report ``cached_tokens``).
    prompt_tokens: list[int]
    cached_tokens: list[int]
    #: Per worker: results whose cached prefix fell short of the prediction.
    mispredicted: list[int]
    #: Per worker: requests routed to it.
    routed: list[int]
    #: Per worker: routed notices received (prompts other frontends sent it).
    notices: list[int]


class Router:
    """Picks workers (see the module docstring). ``workers``: how many."""

    def __init__(
        self,
        workers: int,
        policy: str = "prefix",
        *,
        balance: int = DEFAULT_BALANCE,
        capacity: int = DEFAULT_CAPACITY,
        block_chars: int = BLOCK_CHARS,
        window: int | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}")
        if balance < 0 or block_chars < 1:
            raise ValueError("routing balance must be >= 0 and block_chars >= 1")
        self.policy = policy
        self.balance = balance
        self.block_chars = block_chars
        self.indexes = [PrefixIndex(capacity) for _ in range(workers)]
        self._capacity = capacity
        self._per_worker_window = window is None
        self._rr = itertools.count()
        #: The last ``window`` decisions (worker indexes), and each worker's count in them.
        self._window: collections.deque[int] = collections.deque(
            maxlen=DEFAULT_WINDOW_PER_WORKER * workers if window is None else window
        )
        self._recent = [0] * workers
        self.stats = RouterStatistics(
            {"prefix": 0, "load": 0, "balance": 0}, [0] * workers, [0] * workers,
            [0] * workers, [0] * workers, [0] * workers,
        )

    def add_worker(self) -> int:
        """One more worker (found by discovery), with an empty index; its number. Its share
        of the recent decisions starts at the others' mean (:meth:`rejoin`)."""
        self.indexes.append(PrefixIndex(self._capacity))
        worker = len(self.indexes) - 1
        stats = self.stats
        for per_worker in (stats.prompt_tokens, stats.cached_tokens, stats.mispredicted,
                           stats.routed, stats.notices):
            per_worker.append(0)
        if self._per_worker_window:  # (the window grows with the pool; its counts stay)
            self._window = collections.deque(
                self._window, maxlen=DEFAULT_WINDOW_PER_WORKER * len(self.indexes))
        self._recent.append(0)
        self._seed(worker)
        return worker

    def rejoin(self, worker: int) -> None:
        """A new worker takes the index ``worker`` of one that left the pool: its prefix
        index starts empty and its share of the recent decisions at the others' mean."""
        self.indexes[worker].clear()
        self._window = collections.deque((w for w in self._window if w != worker),
                                         maxlen=self._window.maxlen)
        self._recent[worker] = 0
        self._seed(worker)

    def _seed(self, worker: int) -> None:
        """Give ``worker`` (holding none of the window) the mean share of the workers that
        hold some, its entries spread evenly among theirs so that they age out as theirs
        do; the oldest entries go if the window is full. Starting at 0, a worker that
        joined looked idle by the others' whole window (32 each), and it took every new
        request until its outstanding ones made that up: about twice its fair share in
        flight, measured by bench/join_balance.py."""
        window = list(self._window)
        maxlen = self._window.maxlen
        others = len(set(window))
        if not others or not maxlen:
            return
        share = min(len(window) // others, maxlen // (others + 1))
        del window[:max(0, len(window) + share - maxlen)]  # (the oldest)
        step = max(1, len(window) // share) if share else 0
        mixed: list[int] = []
        seeded = 0
        for j, w in enumerate(window):
            mixed.append(w)
            if share and (j + 1) % step == 0 and seeded < share:
                mixed.append(worker)
                seeded += 1
        self._window = collections.deque(mixed, maxlen=maxlen)
        counts = collections.Counter(mixed)
        self._recent[:] = [counts[i] for i in range(len(self._recent))]

    @property
    def prefix_aware(self) -> bool:
        return self.policy == "prefix"

    def blocks(self, prompt: object, seed: bytes = b"") -> Blocks:
        """The prompt's blocks, chained from ``seed`` (:func:`prompt_blocks`; none unless
        the policy is prefix-aware)."""
        if not self.prefix_aware:
            return Blocks([], 0, 1)
        return prompt_blocks(prompt, self.block_chars, seed)

    def pick(
        self,
        blocks: Sequence[bytes],
        loads: Sequence[int | None],
        exclude: Sequence[int] = (),
        scores: Sequence[int] | None = None,
    ) -> Decision | None:
        """The worker for a prompt of ``blocks``. ``loads[i]`` is worker i's outstanding
        requests, None where it cannot take requests; ``exclude``: workers not to use.
        None when no worker can take it. Counts the decision in the statistics.
        ``scores[i]``, when given, is worker i's match (tokens held, from its KV events:
        :func:`server.manager.kv_index.prefix_tokens`) in place of its index's.

        The load compared is the outstanding requests plus the worker's share of the last
        ``window`` decisions. A chat between turns has nothing outstanding, yet its next
        turn will follow its prefix. Counting recent decisions keeps a worker that holds a
        prefix every request shares (a common system prompt) from taking all the new
        conversations while loads are low."""
        recent = self._recent if self.policy == "prefix" else [0] * len(loads)
        candidates = [
            (i, load + recent[i])
            for i, load in enumerate(loads) if load is not None and i not in exclude
        ]
        if not candidates:
            return None
        if self.policy == "round-robin":
            i = candidates[next(self._rr) % len(candidates)][0]
            decision = Decision(i, "load", 0)
        else:
            least_i, least_load = min(candidates, key=lambda c: c[1])
            decision = Decision(least_i, "load", 0)
            if self.policy == "prefix" and (blocks or scores):
                match = (scores.__getitem__ if scores is not None
                         else lambda i: self.indexes[i].match(blocks))
                best = max((match(i), -load, -i) for i, load in candidates)
                matched, best_load = best[0], -best[1]
                if matched:
                    if best_load - least_load <= self.balance:
                        decision = Decision(-best[2], "prefix", matched)
                    else:
                        decision = Decision(least_i, "balance", match(least_i))
        self.stats.decisions[decision.reason] += 1
        self.stats.routed[decision.worker] += 1
        window = self._window
        if window.maxlen and self.policy == "prefix":
            if len(window) == window.maxlen:
                recent[window[0]] -= 1
            window.append(decision.worker)
            recent[decision.worker] += 1
        return decision

    def routed(self, worker: int, blocks: Sequence[bytes]) -> None:
        """A prompt of ``blocks`` was sent to ``worker``: it will hold them."""
        if blocks:
            self.indexes[worker].insert(blocks)

    def noticed(self, worker: int, blocks: Sequence[bytes]) -> None:
        """Another frontend sent ``worker`` a prompt of ``blocks`` (a routed notice): it
        will hold them, as if this router had sent it (LRU-marked, bounded alike)."""
        self.stats.notices[worker] += 1
        self.routed(worker, blocks)

    def reset(self, worker: int) -> None:
        """``worker`` restarted (or reconnected): its cache is empty."""
        self.indexes[worker].clear()

    def observed(
        self, worker: int, blocks: Blocks, matched: int, prompt_tokens: int,
        cached_tokens: int,
    ) -> None:
        """A result from ``worker`` reported ``cached_tokens`` of ``prompt_tokens`` for a
        prompt of ``blocks``, ``matched`` of them predicted cached. When the worker had
        clearly less, its cache evicts faster than the index assumed: forget as many of
        the oldest blocks as were mispredicted. Clearly less is under half, and more than
        4 blocks short, since tokens and characters do not map evenly and an engine caches
        whole blocks of its own size (vLLM's 16 to 128 tokens)."""
        stats = self.stats
        stats.prompt_tokens[worker] += prompt_tokens
        stats.cached_tokens[worker] += cached_tokens
        if not matched or prompt_tokens <= 0 or not blocks.units:
            return
        actual = cached_tokens / prompt_tokens * blocks.units / blocks.size  # in blocks
        if actual < matched * 0.5 and matched - actual > 4:
            stats.mispredicted[worker] += 1
            self.indexes[worker].forget_oldest(int(matched - actual))
