"""The sim engine: a GPU-free stand-in for a continuous-batching engine. Sans-IO.

It behaves like a real engine from the frontend's point of view:

* **Timing.** A request admitted at time t produces its first token at exactly
  ``t + ttft_ms + prefill_us_per_token * prompt_tokens`` (so a benchmark can subtract the
  configured TTFT), then one token on each engine tick, every ``itl_ms`` while there is work.
* **Batching.** At most ``max_batch`` requests run; the rest wait in FIFO order and are
  admitted as soon as a slot frees. One tick is one loop over the running requests and
  one STEP frame for all of them: no per-request syscalls.
* **Deterministic output.** Tokens are words drawn from a small vocabulary (with accented,
  CJK and emoji words, to exercise UTF-8) by a generator seeded from the prompt and the seed.
  ``temperature == 0`` ignores the seed; no seed and ``temperature > 0`` is random.
* **Token counts.** The sim tokenizer counts whitespace-separated words of the prompt (or the
  length of a token-id list). Chat messages are rendered with :data:`CHAT_TEMPLATE` first.
* **Images** (only with ``image_tokens > 0``): the HELLO says ``"images": {"per_prompt":
  images_per_prompt}``, and an image part of a chat message (its bytes and SHA-256,
  checked) is rendered as ``image_tokens`` words naming the image: its prompt tokens, as
  vLLM counts an image's. Nothing is decoded. The images it saw lately (the last
  :data:`IMAGE_CACHE_ITEMS`, by SHA-256) model vLLM's processed-image cache: each PONG
  counts the lookups and hits (``mm_cache_queries``, ``mm_cache_hits``), as the vllm
  engine's does.
* **Scheduling policy** (``scheduling_policy``, vLLM's ``--scheduling-policy``): with
  ``"fcfs"`` (the default) a request's non-zero ``priority`` is refused, as vLLM refuses
  it. With ``"priority"`` the HELLO lists ``priority`` among its sampling fields, and the
  waiting requests are admitted lowest ``priority`` first, then in arrival order. Nothing
  running is preempted: the sim has no KV cache to run out of.
* **Prefix cache** (only with ``prefix_cache_tokens > 0``): a model of vLLM's automatic
  prefix caching (:class:`server.engines.sim.cache.PrefixCache`: blocks of
  ``prefix_block_size`` words, chained hashes, LRU eviction). A request's first token then
  comes ``prefill_us_per_token`` per *uncached* prompt token after ``ttft_ms``, and its
  last output carries a note ``{"cached_tokens": n}`` as vLLM's does.
* **Finishing.** ``length`` at ``max_tokens``; ``stop`` when a stop string appears in the
  text (text that could be the start of a stop string is held back until it is decided, and
  the stop string itself is never sent). A request without ``max_tokens`` (a chat
  client's default) ends as a model's does, at an end of sequence: after
  :func:`end_of_sequence` tokens (32 to 256, drawn from the seed, or the prompt when
  greedy), with ``stop`` (``length`` if the context ends first); ``ignore_eos`` runs it to
  the context. With ``max_tokens`` the answer is that long exactly, as benchmarks and
  tests count on.
* **Structured output** (:mod:`server.engines.sim.structured`). A ``response_format`` is
  answered with an instance of its schema (``{}`` for ``json_object``; one of the strings of
  a ``choice``), a few characters a token, then ``stop`` (``length`` when ``max_tokens`` is
  too short); its ``anyOf`` branches and ``enum`` values are drawn with the request's
  generator. The forced call of ``tool_choice`` ``required`` or a named function is such a
  format (the array of calls, each call's ``arguments`` the smallest instance of its
  ``parameters``), and so is ``auto`` with a JSON format (the calls or the document, by
  seed). A schema the sim cannot build simply (``pattern``, most ``format`` values, ...)
  and ``regex`` or ``grammar`` constraints are refused, naming the keyword.
* **Tool calls.** A chat request with ``tools`` and no format is answered with one call of
  its first tool in the Hermes format (``<tool_call>{"name": ..., "arguments": {"<its first
  property>": "<words>"}}</tool_call>``, the tags split across tokens), ``max_tokens``
  tokens in all, then ``stop`` (``length`` when ``max_tokens`` is too short for the call).
  Those arguments follow no schema (``tool_choice: auto``).
* **Token ids and resuming** (see docs/routing.md, "Migration"): a request whose params
  ask (``"token_ids": true``) gets a note ``{"token_ids": [id]}`` with each token (the word's
  index in the vocabulary; the reasoning tags and a tool call's pieces have ids of their
  own, :func:`token_text`). A request whose params carry ``"resume": {"token_ids": [...],
  "text_chars": k}`` continues one whose worker died. Its prompt counts the generated
  tokens too (one prefill of them all). Its generator is replayed through them, so a
  greedy or seeded request goes on exactly as it would have, and an unseeded one goes on
  with fresh randomness. ``max_tokens`` is what is left, and the text of those tokens beyond
  the ``k`` characters the client already has (held back for a stop string) is fed to the
  stop matcher first.
* **LoRA adapters** (only with ``enable_lora``; :mod:`server.engines.sim.lora`): the vllm
  engine's options and wire ops, with no weights. A request through an adapter opens its
  answer with the adapter's tag, ``" [name]"`` (:func:`~server.engines.sim.lora.tag`),
  riding on its first answer token (after the reasoning, when there is some): the base
  answer's tokens and count are unchanged. A format's or a tool call's answer carries no
  tag (its JSON stays whole). Its prompt's prefix cache blocks are its own, as vLLM's are,
  and at most ``max_loras`` adapters run at once.
* **Fault injection** (only when built with ``faults=True``): a request may carry
  ``{"fault": {"kind": K, "after": k}}``, where K is one of:

  - ``error``: fail with an engine error after k tokens;
  - ``crash``: the worker process dies after k tokens;
  - ``hang``: the whole worker stops answering after k tokens;
  - ``garbage``: the worker writes bytes that are not a frame on its pipe after k tokens;
  - ``stall``: this request stops producing output after k tokens;
  - ``ignore_abort``: aborts of this request are ignored;
  - ``slow_step``: the step that gives token k+1 computes, holding the loop as a long
    forward pass does, for ``"seconds"``, then the request goes on;
  - ``stuck_step``: that step blocks for ever without computing, as a deadlock does.

  An ``embed`` request may carry
  ``{"fault": {"kind": "slow_step", "seconds": s}}``: it computes that long first.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import random
import time
import zlib
from collections import OrderedDict
from collections.abc import ValuesView

from ...worker_protocol.images import image_parts
from ...worker_protocol.wire import OutputRow
from ...workers.base import (
    TRUNCATION_FIELDS,
    Rejected,
    WorkerCrash,
    WorkerGarbage,
    WorkerHang,
    check_context,
    prompt_param,
    read_sampling,
    truncate_prompt,
)
from ..transformers.grammar import describe, format_param
from ...workers.resume import resume_of
from .cache import PrefixCache
from .lora import SimAdapters, tag
from .structured import Unbuildable, instance
from ...workers.stops import StopMatcher

__all__ = ["SimEngine", "CHAT_TEMPLATE", "render_chat", "count_tokens", "end_of_sequence",
           "token_text"]

_VOCAB = (
    "the", "a", "model", "token", "stream", "trio", "nursery", "cancel", "scope", "worker",
    "pipe", "frame", "engine", "batch", "step", "request", "server", "client", "event",
    "data", "is", "of", "and", "to", "in", "runs", "sends", "waits", "reads", "writes",
    "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "café", "naïve", "日本",
    "語", "数据", "🙂", "🚀", "résumé", "über", "ok", "yes", "no", "then", "when",
    "while", "done", "fast", "slow", "light", "heavy", "north", "south", "east", "west",
    "one", "two", "three",
)
_VOCAB_SPACED = tuple(" " + w for w in _VOCAB)
_V = len(_VOCAB_SPACED)
#: Token ids beyond the vocabulary's: the reasoning tags, then a tool call's pieces (by
#: their position in the call).
_THINK = _V
_THINK_END = _V + 1
_CALL = _V + 2

#: The sim engine's chat template: each message as ``<|role|>`` then its content on one
#: line, then ``<|assistant|>`` to prompt the answer.
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|> {{ m.content }}\n{% endfor %}<|assistant|>"

#: The largest embedding_size of a sim engine.
_MAX_EMBEDDING = 4096
#: Where a request without max_tokens ends (:func:`end_of_sequence`): this many tokens at
#: least, and fewer than this many more.
_EOS_MIN = 32
_EOS_SPAN = 225
#: The characters of structured output per token.
_CHARS_PER_TOKEN = 4


def _compute_for(seconds: float) -> None:
    """Hold the CPU (and the loop) for ``seconds``: the ``slow_step`` fault."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


FAULT_KINDS = ("error", "crash", "hang", "garbage", "stall", "ignore_abort", "slow_step",
               "stuck_step")


#: How many images (by SHA-256) the image cache's model keeps.
IMAGE_CACHE_ITEMS = 1024


def render_chat(messages: list, image_tokens: int = 0) -> str:
    """Render chat messages with :data:`CHAT_TEMPLATE` (without a template engine). A
    content of parts (a message with images) is its text parts and, for each image part,
    ``image_tokens`` words ``<image:H>`` (H: the start of the image's SHA-256), so an image
    counts that many prompt tokens and the answer depends on it; a 400 (Rejected) naming
    the message when an image's bytes are not the SHA-256 they came with."""
    parts = []
    for i, m in enumerate(messages):
        content = m["content"]
        if isinstance(content, list):
            content = "".join(_rendered_part(p, image_tokens, f"messages[{i}].content")
                              for p in content)
        parts.append(f"<|{m['role']}|> {content}\n")
    parts.append("<|assistant|>")
    return "".join(parts)


def _rendered_part(part: object, image_tokens: int, param: str) -> str:
    """One part of a message's content, as :func:`render_chat` writes it."""
    if not isinstance(part, dict):
        raise Rejected("a content part must be an object", param=param)
    if part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if part.get("type") != "image" or not image_tokens:
        raise Rejected("this engine takes text parts only", param=param)
    data, digest = part.get("data"), part.get("sha256")
    if not isinstance(data, bytes) or not isinstance(digest, str):
        raise Rejected("an image part needs 'data' (bytes) and 'sha256'", param=param)
    if hashlib.sha256(data).hexdigest() != digest:  # (the bytes did not arrive intact)
        raise Rejected("an image's bytes do not match its sha256", param=param)
    return " " + " ".join([f"<image:{digest[:12]}>"] * image_tokens) + " "


@functools.lru_cache(maxsize=1024)
def _token_vector(token: str | int, size: int) -> tuple[float, ...]:
    """The sim's fixed random vector of a token (its first items do not depend on size)."""
    rng = random.Random(zlib.crc32(repr(token).encode()))
    return tuple(rng.gauss(0.0, 1.0) for _ in range(size))


def count_tokens(text: str) -> int:
    """The sim tokenizer: one token per whitespace-separated word."""
    return len(text.split())


class _Req:
    __slots__ = (
        "rid", "rng", "max_tokens", "stop", "produced", "ready_at",
        "fault", "fault_after", "fault_seconds", "prompt_tokens", "started", "call", "blocks", "cached",
        "ids", "pending", "end", "lora", "tag", "priority",
    )
    rid: int
    rng: int  # the state of a 32-bit xorshift generator
    max_tokens: int
    stop: StopMatcher | None
    produced: int
    ready_at: float
    fault: str | None
    fault_after: int
    fault_seconds: float
    prompt_tokens: int
    started: bool
    call: list[str] | None  # the tokens of a tool call or a format's text (see add)
    blocks: list[int]  # the prompt's block hashes (prefix cache on)
    cached: int  # prompt tokens found in the prefix cache
    ids: bool  # send each token's id (a note)
    pending: str  # text released by a resume, sent with the first output
    end: str  # the finish reason at max_tokens: "length", or "stop" at an end of sequence
    lora: int  # its adapter's id (0: the base model)
    tag: str | None  # the text its answer opens with (an adapter's, on a plain answer)
    priority: int  # its place in the waiting queue under the priority policy (lower first)


class SimEngine:
    """See the module docstring. ``clock`` gives the admission time of requests (tests may
    pass a fake one); the worker loop passes ``now`` to :meth:`step`."""

    def __init__(
        self,
        *,
        model: str = "sim",
        itl_ms: float = 8.0,
        ttft_ms: float = 20.0,
        prefill_us_per_token: float = 20.0,
        max_batch: int = 256,
        max_model_len: int = 8192,
        faults: bool = False,
        startup_delay_ms: float = 0.0,
        reasoning_tokens: int = 0,
        prefix_cache_tokens: int = 0,
        prefix_block_size: int = 16,
        embedding_size: int = 384,
        max_embed_tokens: int = 16384,
        image_tokens: int = 0,
        images_per_prompt: int = 4,
        enable_lora: bool = False,
        max_loras: int | None = None,
        lora_modules: dict | None = None,
        allow_runtime_lora: bool = False,
        lora_dir: str | None = None,
        scheduling_policy: str = "fcfs",
        clock=time.monotonic,
    ) -> None:
        if not 0 < embedding_size <= _MAX_EMBEDDING:
            raise ValueError(f"embedding_size must be between 1 and {_MAX_EMBEDDING}")
        if max_batch < 1 or max_model_len < 2:
            raise ValueError("the sim engine needs max_batch >= 1 and max_model_len >= 2")
        if itl_ms < 0 or ttft_ms < 0 or prefill_us_per_token < 0:
            raise ValueError("the sim engine's times must not be negative")
        if scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"the sim engine's scheduling_policy must be 'fcfs' or 'priority', "
                             f"not {scheduling_policy!r}")
        if startup_delay_ms:  # pretend to load weights (lets tests see a starting server)
            time.sleep(startup_delay_ms / 1000.0)
        self._clock = clock
        self.embedding_size = embedding_size
        #: Most tokens one embeddings request may hold (as the transformers engine's cap:
        #: a 4 MB request computed for 22 s, and every stream on the worker waited).
        self.max_embed_tokens = max(max_embed_tokens, max_model_len)
        self.itl = itl_ms / 1000.0
        self.ttft = ttft_ms / 1000.0
        self.prefill = prefill_us_per_token / 1e6
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.faults = faults
        #: A reasoning model's shape: each answer opens with "<think>", this many words,
        #: "</think>" (a token each), then the answer.
        self.reasoning_tokens = reasoning_tokens
        self.info = {
            "engine": "sim",
            "model": model,
            "max_model_len": max_model_len,
            "max_batch": max_batch,
            "chat_template": CHAT_TEMPLATE,
            "sampling": ["tools", "response_format", *TRUNCATION_FIELDS,
                         *(["priority"] if scheduling_policy == "priority" else [])],
            "resume": True,
            "embedding": {"size": embedding_size, "dimensions": True},
        }
        #: Prompt tokens per image (0: the engine takes text only).
        self.image_tokens = image_tokens
        if image_tokens > 0:
            if images_per_prompt < 1:
                raise ValueError("the sim engine's images_per_prompt must be at least 1")
            self.info["images"] = {"per_prompt": images_per_prompt}
        #: The images seen lately, by SHA-256, oldest first (None: text only); the lookups
        #: and hits since the start (:meth:`engine_stats`).
        self._images: OrderedDict[str, None] | None = (
            OrderedDict() if image_tokens > 0 else None)
        self.image_lookups = [0, 0]
        #: Embedding batches computed (one per embed call, however many inputs it has).
        self.forwards = 0
        #: Simulated LoRA adapters (None: off), and the adapters of the running requests:
        #: adapter id -> how many run with it.
        self.adapters: SimAdapters | None = None
        self._batch_loras: dict[int, int] = {}
        if enable_lora:
            self.adapters = SimAdapters(
                lora_modules or {}, max_loras=1 if max_loras is None else max_loras,
                lora_dir=lora_dir, allow_runtime=allow_runtime_lora, served_model=model)
            self.info["lora"] = self.adapters.describe()
            self.load_lora = self.adapters.load_lora
            self.unload_lora = self.adapters.unload_lora
        else:  # (each one given would be ignored: refused by name, as the CLI does)
            given = [name for name, value in (
                ("max_loras", max_loras is not None), ("lora_modules", lora_modules),
                ("allow_runtime_lora", allow_runtime_lora), ("lora_dir", lora_dir)) if value]
            if given:
                raise ValueError(f"the sim engine's {', '.join(given)} need enable_lora "
                                 "(--enable-lora)")
        #: Where an answer's first token is (its tag goes there): after the reasoning.
        self._answer_at = reasoning_tokens + 2 if reasoning_tokens else 0
        #: Whether waiting requests are admitted by their priority (vLLM's "priority").
        self.priority_policy = scheduling_policy == "priority"
        self._running: dict[int, _Req] = {}
        self._waiting: dict[int, _Req] = {}  # insertion order is arrival order
        self._starting: dict[int, _Req] = {}  # running, first token not yet produced
        self._next_tick: float | None = None
        #: The prefix cache (None: off, and no cached_tokens notes).
        self.cache = (
            PrefixCache(prefix_cache_tokens, prefix_block_size) if prefix_cache_tokens else None
        )
        #: [rid, {"cached_tokens": n}] of requests that finished (the worker loop sends them).
        self.notes: list = []

    # -- the Engine interface ---------------------------------------------------------------

    def embed(self, inputs: list, options: dict) -> tuple[list, int]:
        """Deterministic unit vectors, one per input (a string's words or a token-id list):
        the normalised sum of a fixed random vector per token, so that inputs sharing
        tokens are alike. ``dimensions`` cuts them first (any size: Matryoshka-style)."""
        fault = options.get("fault")
        if self.faults and isinstance(fault, dict) and fault.get("kind") == "slow_step":
            _compute_for(float(fault.get("seconds", 0.0)))  # as a big forward pass does
        full = self.embedding_size
        size = options.get("dimensions") or full
        rows = []
        for i, item in enumerate(inputs):
            tokens = item.split() if isinstance(item, str) else item
            if not tokens:
                raise Rejected(f"input[{i}] has no tokens", param=f"input[{i}]")
            if len(tokens) > self.max_model_len:
                raise Rejected(f"input[{i}] has {len(tokens)} tokens; this model's maximum "
                               f"context length is {self.max_model_len} tokens",
                               param=f"input[{i}]")
            rows.append(tokens)
        total = sum(map(len, rows))
        if total > self.max_embed_tokens:  # (its computing holds the worker's loop)
            raise Rejected(f"input: {len(rows)} inputs of {total} tokens in all are more than "
                           f"the {self.max_embed_tokens} tokens one request may hold here; "
                           "send fewer inputs per request", param="input")
        vectors = []
        for tokens in rows:
            sums = [sum(col) for col in zip(*(_token_vector(t, full)[:size] for t in tokens))]
            norm = math.sqrt(sum(x * x for x in sums)) or 1.0
            vectors.append([x / norm for x in sums])
        self.forwards += 1
        return vectors, total

    def engine_stats(self) -> dict | None:
        """The image cache's counters for a PONG, with images on (else None)."""
        if self._images is None:
            return None
        queries, hits = self.image_lookups
        return {"mm_cache_queries": queries, "mm_cache_hits": hits}

    def _look_up_images(self, messages: list) -> None:
        """Count the images of a rendered chat in the image cache's model, and keep them."""
        seen = self._images
        if seen is None:
            return
        for part in image_parts(messages):
            digest = part["sha256"]
            self.image_lookups[0] += 1
            if digest in seen:
                self.image_lookups[1] += 1
                seen.move_to_end(digest)
            else:
                seen[digest] = None
                if len(seen) > IMAGE_CACHE_ITEMS:
                    seen.popitem(last=False)

    def add(self, rid: int, prompt: object, params: dict) -> int:
        if isinstance(prompt, dict):
            messages = prompt.get("messages")
            if not isinstance(messages, list):
                raise Rejected("messages must be a list", param="messages")
            try:
                text = render_chat(messages, self.image_tokens)
            except (KeyError, TypeError):
                raise Rejected("each message needs a role and a content",
                               param="messages") from None
            self._look_up_images(messages)
            seed_bytes = text.encode()
            tokens: list = text.split()
        elif isinstance(prompt, str):
            seed_bytes = prompt.encode()
            tokens = prompt.split()
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            seed_bytes = repr(prompt).encode()
            tokens = prompt
        else:
            raise Rejected("prompt must be a string or a list of token ids", param="prompt")
        tokens = truncate_prompt(tokens, params, self.max_model_len)
        prompt_tokens = len(tokens)
        sampling = read_sampling(params)
        priority = self._priority(params)
        max_tokens, temperature, seed, stop = (sampling.max_tokens, sampling.temperature,
                                               sampling.seed, sampling.stop)
        resumed = resume_of(params.get("resume"))
        generated = resumed[0] if resumed is not None else []
        max_tokens = check_context(prompt_tokens + len(generated), max_tokens,
                                   self.max_model_len, prompt_param(prompt)) + len(generated)

        req = _Req()
        req.rid = rid
        if temperature == 0:
            req.rng = zlib.crc32(seed_bytes)
        elif seed is None:
            req.rng = random.getrandbits(32)
        else:
            req.rng = zlib.crc32(seed_bytes, int(seed) & 0xFFFFFFFF)
        req.end = "length"
        fmt = params.get("response_format")
        if params.get("max_tokens") is None and not params.get("ignore_eos") and not fmt:
            # (a format's answer ends where its text does, as a grammar allows no EOS before)
            end = max(end_of_sequence(req.rng), len(generated) + 1)
            if end < max_tokens:
                max_tokens, req.end = end, "stop"
        req.max_tokens = max_tokens
        req.stop = StopMatcher(tuple(stop)) if stop else None
        req.produced = 0
        req.started = False
        req.prompt_tokens = prompt_tokens
        req.ready_at = 0.0
        req.fault = None
        req.fault_after = 0
        req.fault_seconds = 0.0
        if fmt:
            req.call = _formatted(fmt, req.rng)
        else:
            req.call = _tool_call(params.get("tools"), max_tokens, req.rng)
        req.ids = bool(params.get("token_ids"))
        req.priority = priority
        req.pending = ""
        adapter = params.get("lora")  # (only where info["lora"]: server.workers.main)
        req.lora = 0
        req.tag = tag(adapter) if adapter is not None and req.call is None else None
        if resumed is not None:
            self._replay(req, *resumed)
            tokens = [*tokens, *generated]
            req.prompt_tokens = prompt_tokens = len(tokens)
        req.blocks = self.cache.hashes(tokens, adapter) if self.cache is not None else []
        req.cached = 0
        fault = params.get("fault")
        if self.faults and isinstance(fault, dict):
            if fault.get("kind") not in FAULT_KINDS:
                raise Rejected(f"fault.kind must be one of {', '.join(FAULT_KINDS)}",
                               param="fault")
            req.fault = fault["kind"]
            req.fault_after = int(fault.get("after", 0))
            req.fault_seconds = float(fault.get("seconds", 0.0))
        if adapter is not None:  # (last: nothing refuses the request after it holds one)
            assert self.adapters is not None
            req.lora = self.adapters.use(rid, adapter)
        self._waiting[rid] = req
        self._admit(self._clock())
        return prompt_tokens

    def abort(self, rid: int) -> bool:
        req = self._running.get(rid) or self._waiting.get(rid)
        if req is None or req.fault == "ignore_abort":
            return False
        if req.lora:
            self._leave(req)
        self._running.pop(rid, None)
        self._waiting.pop(rid, None)
        self._starting.pop(rid, None)
        if self._waiting:
            self._admit(self._clock())  # the freed slot goes to the next in line
        return True

    def next_deadline(self) -> float | None:
        tick = self._next_tick
        if self._starting:
            first = min(r.ready_at for r in self._starting.values())
            return first if tick is None else min(first, tick)
        return tick

    def running(self) -> int:
        return len(self._running)

    def waiting(self) -> int:
        return len(self._waiting)

    def step(self, now: float) -> list[OutputRow]:
        running = self._running
        tick = self._next_tick
        is_tick = tick is not None and now >= tick
        outputs = []
        finished = []
        candidates: list[_Req] | ValuesView[_Req]
        if is_tick:
            candidates = running.values()
        else:
            candidates = list(self._starting.values())
        for req in candidates:
            if not req.started:
                if req.ready_at > now:
                    continue
                req.started = True
                del self._starting[req.rid]
            out = self._advance(req)
            if out is not None:
                outputs.append(out)
                if out.finish is not None:
                    finished.append(req)
                    if self.cache is not None and out.finish != "error":
                        self.notes.append([req.rid, {"cached_tokens": req.cached}])
        for req in finished:
            if req.lora:
                self._leave(req)
            del running[req.rid]
            self._starting.pop(req.rid, None)
        if self._waiting and len(running) < self.max_batch:
            self._admit(now)
        if tick is not None and is_tick:
            tick += self.itl
            if tick < now:  # the loop fell behind: keep the cadence from now on
                tick = now + self.itl
        if len(running) == len(self._starting):
            tick = None  # nothing is past its first token: no ticks until one is
        elif tick is None:
            tick = now + self.itl
        self._next_tick = tick
        return outputs

    # -- internals --------------------------------------------------------------------------

    def _priority(self, params: dict) -> int:
        """A request's ``priority`` (0 when not given), refused as vLLM refuses it: not an
        integer, or not 0 without the priority policy."""
        value = params.get("priority")
        if value is None:
            return 0
        if not isinstance(value, int) or isinstance(value, bool):
            raise Rejected("priority must be an integer", param="priority")
        if value and not self.priority_policy:  # (vLLM's words)
            raise Rejected(f"Got priority {value} but Priority scheduling is not enabled.",
                           param="priority")
        return value

    def _queue(self) -> list[int] | dict[int, _Req]:
        """The waiting requests' ids in the order they are admitted: arrival order, or,
        under the priority policy, lowest priority first (a stable sort: then arrival)."""
        waiting = self._waiting
        if not self.priority_policy:
            return waiting
        return sorted(waiting, key=lambda rid: waiting[rid].priority)

    def _admit(self, now: float) -> None:
        room = self.max_batch - len(self._running)
        if room <= 0:
            return
        waiting = self._waiting
        cache = self.cache
        if self.adapters is None:  # (not a copy of the whole queue under fcfs)
            rids = list(itertools.islice(self._queue(), room))
        else:
            rids = self._admissible(room)
        loras = self._batch_loras
        for rid in rids:
            req = waiting.pop(rid)
            if cache is not None:
                req.cached = cache.admit(req.blocks, req.prompt_tokens)
            req.ready_at = now + self.ttft + self.prefill * (req.prompt_tokens - req.cached)
            self._running[rid] = req
            self._starting[rid] = req
            if req.lora:
                loras[req.lora] = loras.get(req.lora, 0) + 1

    def _admissible(self, room: int) -> list[int]:
        """The waiting requests to admit, up to ``room``, in queue order (:meth:`_queue`),
        with at most ``max_loras`` adapters running: a request of one more is passed over,
        as vLLM's scheduler does (it waits; later ones may run first)."""
        assert self.adapters is not None
        room_for = self.adapters.max_loras - len(self._batch_loras)
        added: set[int] = set()
        out: list[int] = []
        waiting = self._waiting
        for rid in self._queue():
            req = waiting[rid]
            if len(out) == room:
                break
            if req.lora and req.lora not in self._batch_loras and req.lora not in added:
                if len(added) == room_for:
                    continue
                added.add(req.lora)
            out.append(rid)
        return out

    def _leave(self, req: _Req) -> None:
        """Request ``req``, of an adapter, ends (finished or aborted): its hold ends."""
        assert self.adapters is not None
        self.adapters.release(req.rid)
        if req.rid in self._running:
            left = self._batch_loras[req.lora] - 1
            if left:
                self._batch_loras[req.lora] = left
            else:
                del self._batch_loras[req.lora]

    def _next_token(self, req: _Req) -> tuple[str, int]:
        """Draw the next token of ``req``: its text and id (does not count it produced)."""
        x = (req.rng * 1103515245 + 12345) & 0xFFFFFFFF
        req.rng = x
        token = (x >> 16) % _V
        word = _VOCAB_SPACED[token]
        if self.reasoning_tokens:
            if req.produced == 0:
                word, token = "<think>", _THINK
            elif req.produced == self.reasoning_tokens + 1:
                word, token = "</think>", _THINK_END
        if req.call is not None:
            word, token = req.call[req.produced], _CALL + req.produced
        if req.tag is not None:  # (an adapter's request)
            word = self._opened(req, word)
        return word, token

    def _opened(self, req: _Req, word: str) -> str:
        """``word``, with the tag of the request's adapter before it when it opens the
        answer."""
        if req.tag is not None and req.produced == self._answer_at:
            return req.tag + word
        return word

    def _replay(self, req: _Req, generated: list[int], text_chars: int) -> None:
        """Bring a resumed request to where its first run stopped (see the module
        docstring): the generator replayed through ``generated``, and the text of those
        tokens past the client's ``text_chars`` fed to the stop matcher."""
        texts = []
        for token in generated:
            word, mine = self._next_token(req)
            if mine != token:  # unseeded sampling: the first run drew other tokens
                word = self._opened(req, token_text(token, req.call))
            texts.append(word)
            req.produced += 1
        if req.produced >= req.max_tokens:
            raise Rejected("resume: no tokens left to generate", "engine_error")
        held = "".join(texts)[text_chars:]
        if req.stop is not None:
            held, stopped = req.stop.feed(held)
            if stopped:
                raise Rejected("resume: the generated text already holds a stop string",
                               "engine_error")
        req.pending = held

    def _advance(self, req: _Req) -> OutputRow | None:
        fault = req.fault
        if fault is not None and req.produced >= req.fault_after:
            if fault == "error":
                return OutputRow(req.rid, "", 0, "error", ["engine_error", "injected engine failure"])
            if fault == "crash":
                raise WorkerCrash()
            if fault == "hang":
                raise WorkerHang()
            if fault == "garbage":
                raise WorkerGarbage()
            if fault == "stall":
                return None
            if fault == "slow_step":  # once: this step computes for that long
                req.fault = None
                _compute_for(req.fault_seconds)
            if fault == "stuck_step":  # blocked for ever without computing (a deadlock)
                while True:
                    time.sleep(3600)
        word, token = self._next_token(req)
        if req.ids:
            self.notes.append([req.rid, {"token_ids": [token]}])
        if req.pending:  # released by a resume: goes first
            word, req.pending = req.pending + word, ""
        if req.call is not None:
            if req.produced + 1 == len(req.call) < req.max_tokens + 1:
                req.produced += 1
                return OutputRow(req.rid, word, 1, "stop", None)
        req.produced += 1
        done = req.produced >= req.max_tokens
        if req.stop is None:
            return OutputRow(req.rid, word, 1, req.end if done else None, None)
        text, stopped = req.stop.feed(word)
        if stopped:
            return OutputRow(req.rid, text, 1, "stop", None)
        if done:
            return OutputRow(req.rid, text + req.stop.flush(), 1, req.end, None)
        return OutputRow(req.rid, text, 1, None, None)


def token_text(token: int, call: list[str] | None = None) -> str:
    """The text of one of the sim's token ids (a tool call's pieces: of ``call``)."""
    if 0 <= token < _V:
        return _VOCAB_SPACED[token]
    if token == _THINK:
        return "<think>"
    if token == _THINK_END:
        return "</think>"
    if call is not None and 0 <= token - _CALL < len(call):
        return call[token - _CALL]
    raise Rejected(f"resume: token id {token} is not the sim's", "engine_error")


def end_of_sequence(rng: int) -> int:
    """Where the sim ends an answer without ``max_tokens`` (see the module docstring):
    a number of tokens from :data:`_EOS_MIN` on, drawn from the request's generator as it
    starts (``rng``: the same seed, or the same greedy prompt, the same length)."""
    return _EOS_MIN + zlib.crc32(b"eos", rng) % _EOS_SPAN


def _formatted(fmt: dict, rng: int) -> list[str]:
    """The tokens of the sim's answer to a ``response_format`` (see the module docstring),
    its choices drawn from a generator started at ``rng``; :class:`Rejected` naming the
    format and the reason for one the sim cannot answer."""
    state = [rng]

    def pick(n: int) -> int:
        state[0] = (state[0] * 1103515245 + 12345) & 0xFFFFFFFF
        return (state[0] >> 16) % n

    kind = fmt.get("type")
    try:
        if kind == "json_object":
            text = "{}"
        elif kind == "json_schema":
            text = json.dumps(instance(fmt.get("schema", True), pick), ensure_ascii=False,
                              separators=(",", ":"))
        elif kind == "choice":
            choices = fmt.get("choice") or [""]
            text = choices[pick(len(choices))]
        else:
            raise Unbuildable(f"the sim engine writes JSON and choices, not a {kind}")
    except Unbuildable as exc:
        raise Rejected(f"{describe(fmt)}: {exc}", param=format_param(fmt)) from None
    return [text[i:i + _CHARS_PER_TOKEN] for i in range(0, len(text), _CHARS_PER_TOKEN)] or [""]


def _tool_call(tools, max_tokens: int, rng: int) -> list[str] | None:
    """The tokens of the sim's tool call (see the module docstring), or None without tools."""
    if not tools:
        return None
    fn = tools[0]["function"]
    props = list((fn.get("parameters") or {}).get("properties") or ()) or ["text"]
    head = ["<tool_", "call>", '{"name": ', json.dumps(fn["name"]), ', "arguments": {',
            json.dumps(props[0]) + ':', ' "']
    tail = ['"}}', "</tool", "_call>"]
    words = []
    for _ in range(max(1, max_tokens - len(head) - len(tail))):
        rng = (rng * 1103515245 + 12345) & 0xFFFFFFFF
        words.append(_VOCAB[(rng >> 16) % _V] + " ")
    return head + words + tail
