"""The request manager: dispatch requests to workers by load, and own the workers' lifetimes.

This is the embeddable API. A Trio program opens an engine and generates::

    async with open_engine(EngineConfig(workers=2)) as engine:
        async with engine.generate("Once upon a time", SamplingParams(max_tokens=16)) as s:
            async for out in s:
                print(out.text, end="")

Cancellation is ordinary Trio cancellation: cancel the scope around the ``async for`` and the
engine request is aborted (see :mod:`server.manager.stream`).
"""

from __future__ import annotations

import itertools
import weakref
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import trio
from trio_util import AsyncValue, wait_all

from ..config import EngineConfig
from ..errors import ClientError, EngineError, ServiceUnavailable
from ..observability.engine_metrics import EngineReport
from ..params import SamplingParams, truncated
from ..worker_protocol import wire
from ..discovery.names import DnsName, parse_worker_address
from ..discovery.pool import DiscoveredPool
from ..discovery.watch import WatchStatistics
from .adapters import AdapterRegistry
from .batch_priority import honours_priority, in_batch_work, needs_priority, scheduled
from ..worker_protocol.images import image_count, takes_images
from ..worker_protocol.kv_blocks import seed_of
from .deadlines import QUEUE_TIMEOUT, DeadlineQueue
from .kv_index import prefix_tokens
from .migration import MigrationStatistics, Migrator
from .routing import Blocks, Decision, Router, RouterStatistics
from .stream import Choice, RequestStream, Waker
from .unwrap import body_errors_unwrapped
from .worker import WorkerClient, WorkerStartupError

__all__ = ["Engine", "EngineStatistics", "WorkerStatistics", "open_engine", "run_engine"]


@dataclass(frozen=True)
class WorkerStatistics:
    index: int
    alive: bool
    healthy: bool
    pid: int | None
    outstanding: int
    restarts: int
    #: Over its restart budget: retried at the capped backoff (server.restarts).
    over_budget: bool
    #: Requests running and waiting in the worker, from its latest heartbeat answer.
    running: int = 0
    waiting: int = 0
    #: What the engine reports of itself (server.observability.engine_metrics).
    report: EngineReport | None = None
    #: Its address left discovery (server.discovery): draining, or gone.
    retired: bool = False


@dataclass(frozen=True)
class EngineStatistics:
    """A snapshot: streams open in the manager, and each worker's state."""

    open_streams: int
    outstanding: int
    workers_alive: int
    accepting: bool
    workers: tuple[WorkerStatistics, ...]
    #: Sequences (prompts x n) of the open streams.
    open_sequences: int = 0
    #: Routing decisions and per-worker prefix-cache hits (server.manager.routing).
    routing: RouterStatistics | None = None
    #: Requests moved off dead workers (server.manager.migration); None: migration is off
    #: and no request a leaving worker did not take was sent again.
    migration: MigrationStatistics | None = None
    #: Each DNS name's resolutions (server.discovery.watch); empty: no name is watched.
    discovery: tuple[tuple[str, WatchStatistics], ...] = ()


class Engine:
    """Dispatches requests over worker processes. Build it with :func:`open_engine`."""

    def __init__(self, config: EngineConfig, *, spawn=None) -> None:
        self.config = config
        #: Workers found by DNS names (server.discovery.pool); None: none is named.
        self.discovery: DiscoveredPool | None = None
        if config.worker_addresses:  # remote workers: one per address, connected to
            _check_remote(config)
            addresses = [parse_worker_address(a) if isinstance(a, str) else a
                         for a in config.worker_addresses]
            names = [a for a in addresses if isinstance(a, DnsName)]
            self.workers = [
                WorkerClient(i, config.for_worker(i), address=address)
                for i, address in enumerate(a for a in addresses if a not in names)
            ]
            if names:
                self.discovery = DiscoveredPool(self, names)
        else:
            self.workers = [
                WorkerClient(i, config.for_worker(i), spawn) for i in range(config.workers)
            ]
        #: LoRA adapters: what each name means, on every worker (server.manager.adapters).
        self.adapters = AdapterRegistry(self.workers)
        self.router = Router(
            len(self.workers), config.routing, balance=config.routing_balance
        )
        #: Each worker's restarts as the router last saw them (a restart empties its cache).
        self._generations = [0] * len(self.workers)
        #: A stream's first rid -> (worker index, the first prompt's blocks, blocks
        #: predicted cached), until the stream is released.
        self._routes: dict[int, tuple[int, Blocks, int]] = {}
        self._rids = itertools.count(1)
        #: Streams open (dispatched, not yet released): observable, for wait_idle.
        self._open = AsyncValue(0)
        self._open_sequences = 0
        self._streams: weakref.WeakSet[RequestStream] = weakref.WeakSet()
        self.deadlines = DeadlineQueue()
        self._accepting = True
        #: Moves a dead worker's requests to the others (None: --max-migrations 0).
        self.migrator = Migrator(self, config.max_migrations) if config.max_migrations else None
        #: Sends the SUBMITs a leaving worker refused to the others (with migration off too).
        self._mover = self.migrator or Migrator(self, 0)
        for w in self.workers:
            self._attach(w)

    def static_workers(self) -> list[WorkerClient]:
        """The workers whose service the engine runs (not those of discovery)."""
        return [w for w in self.workers if self.discovery is None
                or not self.discovery.owns(w)]

    def _attach(self, w: WorkerClient) -> None:
        """Hook a worker to the engine's adapters, router and migration."""
        w.replay = self.adapters.replay
        w.noticed = self._noticed
        w.resubmit = self._mover.resubmit
        if self.migrator is not None:
            w.migrate = self.migrator.migrate

    def add_worker(self, address, slot: int | None = None) -> WorkerClient:
        """A worker at ``address`` joins the pool (found by discovery), in ``slot`` (the
        index of one that left, whose service ended) or a new one. Its prefix index starts
        empty. The caller runs its service (:meth:`WorkerClient.run`)."""
        if slot is None:
            slot = self.router.add_worker()
            self._generations.append(0)
            self.workers.append(None)  # type: ignore[arg-type]  # (set below)
        else:
            self.router.rejoin(slot)
            self._generations[slot] = 0
        w = self.workers[slot] = WorkerClient(slot, self.config.for_worker(slot),
                                              address=address)
        self._attach(w)
        return w

    # -- generating --------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        """The served model name: the configured one, else what the workers report."""
        if self.config.model:
            return self.config.model
        for w in self.workers:
            if w.info.get("model"):
                return w.info["model"]
        return self.config.engine

    @property
    def info(self) -> dict:
        """The engine's HELLO info (model, max_model_len, chat_template, ...): the first
        worker's. In a pool of text and vision workers, with the ``images`` of the vision
        worker that takes the most a prompt: image requests are accepted up to that many,
        and routed only to workers that take as many (:meth:`_route`). Likewise with
        ``priority`` among its sampling fields where any worker honours it
        (server.manager.batch_priority)."""
        first = None
        images = None
        priority = False
        for w in self.workers:
            if w.info:
                first = first or w.info
                offer = w.info.get("images")
                if isinstance(offer, dict) and (images is None or offer.get(
                        "per_prompt", 0) > images.get("per_prompt", 0)):
                    images = offer
                priority = priority or honours_priority(w.info)
        if first is None:
            return {}
        merged = first
        if images is not None and first.get("images") is not images:
            merged = {**merged, "images": images}
        if priority and not honours_priority(first):
            merged = {**merged, "sampling": [*(first.get("sampling") or ()), "priority"]}
        return merged

    def generate(
        self,
        prompt: object,
        params: SamplingParams | None = None,
        *,
        timeout: float | None = None,
        errors_as_outputs: bool = False,
    ) -> RequestStream:
        """Start generating for one prompt (``params.n`` choices); never blocks.

        ``prompt`` is a string, a list of token ids, or ``{"messages": [...]}`` for chat.
        Raises :class:`~server.errors.ServiceUnavailable` when no worker can take it.
        """
        return self.generate_many(
            [prompt], params, timeout=timeout, errors_as_outputs=errors_as_outputs
        )

    def generate_many(
        self,
        prompts: Sequence[object],
        params: SamplingParams | None = None,
        *,
        timeout: float | None = None,
        errors_as_outputs: bool = False,
        adapter: str | None = None,
        queue_timeout: float | None = None,
    ) -> RequestStream:
        """Start all prompts at once (``n`` choices each, index ``p * n + i``); never blocks.

        Every sub-request is registered before this returns, so none can finish unseen.
        Requests beyond what the workers run at once wait in their worker's engine queue,
        in arrival order, and start as batch slots free up (as vLLM's do).
        With ``timeout`` (seconds), the server aborts the request when it runs longer: the
        stream then ends each open choice with ``abort`` and ``abort_cause == "timeout"``.
        With ``queue_timeout`` (seconds), it aborts the request if it has not started by
        then (:attr:`RequestStream.started`: no output yet), with ``abort_cause ==
        "queue_timeout"``; ``wait_started`` then raises a 503 ``server_overloaded``.
        With ``adapter``, the prompts run with that LoRA adapter (:attr:`adapters`; a
        worker that does not have it ends them with a 404, ``model_not_found``).
        """
        params = params or SamplingParams()
        router = self.router
        n = params.n
        wire_params = [params.to_wire(i) for i in range(n)]
        key = wire_params[0] if n else {}
        blocks, scores = self._scores(prompts[0] if prompts else None, key, adapter)
        worker, decision = self._route(blocks.hashes, scores=scores,
                                       images=max(map(image_count, prompts), default=0),
                                       priority=needs_priority(key))
        batch = in_batch_work()  # (a line's priority is ours: server.manager.batch_priority)
        # each prompt's blocks, for the prediction (and the worker's other frontends)
        hashes = [blocks.hashes] + [
            router.blocks(*self._route_key(prompt, key, adapter)).hashes
            for prompt in prompts[1:]] if router.prefix_aware else []
        waker = Waker(worker.pacer)
        choices = []
        if self.migrator is not None and worker.info.get("resume"):
            # the tokens' ids, to resume it elsewhere (only an engine that can resume: the
            # others would send ids for nothing, a note per token)
            for wp in wire_params:
                wp["token_ids"] = True
        frames = []
        packs = worker.reads_packed
        sent_params = [scheduled(wp, batch, worker.info) for wp in wire_params]
        for p, prompt in enumerate(prompts):
            sent = wire.pack_ids(prompt) if packs else prompt  # (token ids: long ones packed)
            names = _names_to_send(worker, prompt, hashes[p]) if hashes else None
            for i in range(n):
                choice = Choice(next(self._rids), p * n + i, worker, waker, prompt,
                                wire_params[i], adapter)
                choice.batch = batch
                message = [wire.SUBMIT, choice.rid, sent, sent_params[i]]
                if names and not i:  # (once a prompt)
                    message += [adapter, names]
                elif adapter is not None:
                    message.append(adapter)
                frames.append(wire.encode(message))
                choices.append(choice)
        worker.submit_nowait(choices, frames)  # only once everything could be encoded
        self._open.value += 1
        self._open_sequences += len(choices)
        stream = RequestStream(
            choices, waker, self.config.drain_timeout, self._stream_released, errors_as_outputs
        )
        self._streams.add(stream)
        if choices:  # (for the statistics of every policy, and the prefix index)
            for names in hashes:
                router.routed(worker.index, names)
            # (a match from KV events is exact: nothing to correct)
            self._routes[choices[0].rid] = (worker.index, blocks,
                                            decision.matched if scores is None else 0)
        if timeout is not None:
            self.deadlines.add(trio.current_time() + timeout, stream)
        if queue_timeout is not None:
            self.deadlines.add(trio.current_time() + queue_timeout, stream, QUEUE_TIMEOUT)
        return stream

    async def tokenize(self, request: dict) -> dict:
        """Answer a /tokenize, /detokenize or embed request (a CALL round trip, see
        server.worker_protocol.wire) with the least loaded worker's tokenizer: the one requests
        are served with. Bounded like any worker round trip: a hung worker is stopped by
        the heartbeat, and its round trips fail with EngineError."""
        return await self._pick_worker().call(request)

    def _pick_worker(self) -> WorkerClient:
        """The least loaded live worker (for round trips that use no cache)."""
        if not self._accepting:
            raise ServiceUnavailable("the server is shutting down", code="shutting_down")
        best = None
        best_load = 0
        for w in self.workers:
            # a shared worker's load counts the other frontends' requests (from its PONGs)
            if w.routable and (best is None or w.load < best_load):
                best = w
                best_load = w.load
        if best is None:
            raise ServiceUnavailable("no engine worker is available", code="no_worker")
        return best

    def pick_worker(
        self, prompt: object, exclude: Sequence[int] = (), *,
        params: SamplingParams | dict | None = None, adapter: str | None = None,
        migrating: bool = False,
    ) -> tuple[WorkerClient, Decision]:
        """The worker the routing policy picks for ``prompt``, never one of ``exclude``
        (worker indexes), and why. Raises ServiceUnavailable when none can take it.
        ``params`` (its ``cache_salt``) and ``adapter`` key the prompt's blocks as
        :meth:`generate_many` does: pass the request's, or a salted or adapter prompt
        matches no block. ``migrating``: for a request already accepted
        (server.manager.migration), also while the server drains; the prompt's blocks
        are then noted as sent there. A prompt with images goes to a worker that takes
        as many, as its first pick did (a moved one too)."""
        if isinstance(params, SamplingParams):
            params = params.to_wire()
        blocks, scores = self._scores(prompt, params or {}, adapter)
        picked = self._route(blocks.hashes, exclude, draining_ok=migrating, scores=scores,
                             images=image_count(prompt), priority=needs_priority(params))
        if migrating and self.router.prefix_aware:
            self.router.routed(picked[0].index, blocks.hashes)
        return picked

    def _route_key(self, prompt: object, params: dict, adapter: str | None
                   ) -> tuple[object, bytes]:
        """What names ``prompt``'s blocks as the engine keys its cache. That is the prompt
        as the engine will run it: a token-id prompt cut by ``truncate_prompt_tokens`` as
        the worker cuts it; a text or chat prompt whole, its tokens unknown here. And the
        seed of the chain: its LoRA adapter and ``cache_salt``, whose blocks an engine
        keeps apart. Every pick keys a request so: the first, and a
        migration's."""
        if type(prompt) is list:
            prompt = truncated(prompt, params, self.info.get("max_model_len"))
        return prompt, seed_of((adapter, params.get("cache_salt")))

    def _scores(self, prompt: object, params: dict, adapter: str | None
                ) -> tuple[Blocks, list[int] | None]:
        """A request's blocks (the prediction's) and its exact scores (or None), keyed by
        :meth:`_route_key`."""
        keyed, seed = self._route_key(prompt, params, adapter)
        blocks = self.router.blocks(keyed, seed)
        return blocks, self._exact_scores(keyed, blocks, seed)

    def _exact_scores(self, prompt: object, blocks: Blocks, seed: bytes) -> list[int] | None:
        """Per worker, the tokens of a token-id ``prompt``'s prefix (its chain from
        ``seed``) it holds: exactly where it sends KV events (server.manager.kv_index),
        else as predicted; None for other prompts, or when no worker sends events (the
        router's prediction decides)."""
        if type(prompt) is not list or not self.router.prefix_aware:
            return None
        exact = [w.kv_index for w in self.workers]
        if all(index is None for index in exact):
            return None
        predicted = [index.match(blocks.hashes) * blocks.size
                     for index in self.router.indexes]
        return prefix_tokens(prompt, seed, exact, predicted)

    def _route(
        self, hashes: list[bytes], exclude: Sequence[int] = (), *, draining_ok: bool = False,
        scores: list[int] | None = None, images: int = 0, priority: bool = False,
    ) -> tuple[WorkerClient, Decision]:
        """The worker for a request: of the routable ones, not in ``exclude`` and, for a
        prompt of ``images`` images, one whose HELLO says it takes that many; for a
        client's ``priority``, one that honours it (a 400 naming the field when no worker
        of the pool does: server.manager.batch_priority)."""
        if not self._accepting and not draining_ok:
            raise ServiceUnavailable("the server is shutting down", code="shutting_down")
        router = self.router
        self._forget_restarted()
        # a shared worker's load counts the other frontends' requests (from its PONGs)
        loads = [w.load if w.routable and takes_images(w.info, images) and (
                     not priority or honours_priority(w.info)) else None
                 for w in self.workers]
        decision = router.pick(hashes, loads, exclude, scores)
        if decision is None:
            if priority and not any(honours_priority(w.info) for w in self.workers):
                raise ClientError(
                    "'priority' is not supported here: no worker of this model runs "
                    "priority scheduling (vLLM's --scheduling-policy priority); send 0 or "
                    "leave it out.", param="priority", code="unsupported_parameter")
            what = f"that takes {images} image{'s' * (images > 1)} a prompt " if images else ""
            if priority:
                what += "that schedules by 'priority' "
            raise ServiceUnavailable(f"no engine worker {what}is available", code="no_worker")
        return self.workers[decision.worker], decision

    def _forget_restarted(self) -> None:
        """Clear the prediction of each worker that restarted since the last call (its
        cache is empty)."""
        generations = self._generations
        for w in self.workers:
            if w.generation != generations[w.index]:
                generations[w.index] = w.generation
                self.router.reset(w.index)

    def _noticed(self, index: int, names: list[bytes]) -> None:
        """Worker ``index`` says another frontend sent it a prompt of the blocks ``names``
        (a routed notice, server.manager.worker): predicted as if we had sent it."""
        self._forget_restarted()  # (a notice of this session outlives the last one's reset)
        self.router.noticed(index, names)

    def _stream_released(self, stream: RequestStream) -> None:
        self._streams.discard(stream)
        states = stream.choice_states()
        route = self._routes.pop(states[0].rid, None) if states else None
        if route is not None:
            index, blocks, matched = route
            choice = states[0]
            if (choice.cached_tokens is not None and choice.prompt_tokens
                    and choice.worker is self.workers[index]
                    and self._generations[index] == self.workers[index].generation):
                self.router.observed(
                    index, blocks, matched, choice.prompt_tokens, choice.cached_tokens
                )
        self._open.value -= 1
        self._open_sequences -= stream.choices

    # -- state -------------------------------------------------------------------------------

    @property
    def accepting(self) -> bool:
        return self._accepting

    def stop_accepting(self) -> None:
        """New requests get ServiceUnavailable from now on (the start of a drain)."""
        self._accepting = False

    @property
    def open_streams(self) -> int:
        """Streams dispatched and not yet released (requests in flight)."""
        return self._open.value

    @property
    def open_sequences(self) -> int:
        """Sequences (choices: prompts x n) of the streams in flight."""
        return self._open_sequences

    def abort_all(self, cause: str = "shutdown") -> int:
        """Server-side abort of every open stream (each drains, then ends with ``abort``).

        Returns how many streams were open. Used at the end of a graceful shutdown.
        """
        streams = list(self._streams)
        for stream in streams:
            stream.abort(cause)
        return len(streams)

    async def _abort_open_streams(self) -> None:
        """At exit: abort every open stream, give the workers ``drain_timeout`` to confirm,
        then end what is left with ``abort`` too (as a graceful HTTP shutdown does)."""
        streams = list(self._streams)
        if not streams:
            return
        for stream in streams:
            stream.abort("shutdown")
        with trio.move_on_after(self.config.drain_timeout):
            await wait_all(*(w.wait_released for w in self.workers))
        for stream in streams:
            stream.cut_off()

    def healthy(self) -> bool:
        """True while accepting and at least one worker answered a ping recently (not one
        that left discovery, nor one that said it is stopping: neither takes requests)."""
        return self._accepting and any(
            w.healthy() and not w.retired and not w.leaving for w in self.workers)

    def workers_answering(self) -> int:
        """The workers that answered a ping recently (``WorkerClient.healthy``): what the
        probes count against ``len(workers)`` to say a pool is degraded."""
        return sum(w.healthy() and not w.retired and not w.leaving for w in self.workers)

    @property
    def members(self) -> int:
        """The workers of the pool, up or not: not those whose address left discovery."""
        return sum(not w.retired for w in self.workers)

    async def wait_ready(self) -> None:
        """Wait until every worker has loaded its engine once (said HELLO); at once if
        they have. A worker restarting later does not make this wait again."""
        for w in self.workers:
            await w.wait_ready()

    async def wait_idle(self) -> None:
        """Wait until no stream is open in the manager."""
        await self._open.wait_value(0)

    async def ping_all(self) -> list[tuple[int, int]]:
        """Each live worker's (running, waiting) counts, from a fresh ping round trip. Not
        a worker that discovery removed from the pool, even one removed mid-ping (its session
        is being cut: it would go away before answering)."""
        counts = []
        for w in self.workers:
            if w.alive and not w.removed:
                try:
                    counts.append(await w.ping())
                except EngineError:
                    if not w.removed:
                        raise
        return counts

    def statistics(self) -> EngineStatistics:
        workers = tuple(
            WorkerStatistics(
                w.index, w.alive, w.healthy(), w.pid, w.outstanding, w.restarts, w.over_budget,
                w.running, w.waiting, w.report, w.retired,
            )
            for w in self.workers
        )
        return EngineStatistics(
            open_streams=self._open.value,
            open_sequences=self._open_sequences,
            outstanding=sum(w.outstanding for w in workers),
            workers_alive=sum(w.alive for w in workers),
            accepting=self._accepting,
            workers=workers,
            routing=self.router.stats,
            migration=self._mover.stats if self.migrator is not None
            or self._mover.stats.migrations else None,
            discovery=self.discovery.statistics() if self.discovery is not None else (),
        )


def _names_to_send(worker: WorkerClient, prompt: object, names: list[bytes]
                   ) -> list[bytes] | None:
    """The block names a SUBMIT of ``prompt`` to ``worker`` carries for its other
    frontends: its first :data:`~server.worker_protocol.wire.ROUTED_MAX`, to a worker that
    passes them on, unless they know better (a token-id prompt on a worker that sends KV
    events: every frontend routes it by those)."""
    if not names or not worker.routed_notices or (
            type(prompt) is list and worker.kv_index is not None):
        return None
    return names[:wire.ROUTED_MAX]


def _check_remote(config: EngineConfig) -> None:
    """Refuse what a config with remote workers cannot honour (their engine is theirs)."""
    n = len(config.worker_addresses)
    if config.workers not in (1, n):
        raise ValueError(f"workers={config.workers} with {n} worker addresses: one worker "
                         "per address")
    if config.engine_options or config.devices_per_worker is not None:
        raise ValueError("engine_options and devices_per_worker are the remote workers' "
                         "own: give them to 'python -m server.workers --listen'")


def open_engine(
    config: EngineConfig | None = None, *, wait_ready: bool = True, spawn=None
) -> AbstractAsyncContextManager[Engine]:
    """Start the engine's workers; stop them (shielded, bounded) when the block exits.

    With ``wait_ready`` (the default) the block starts once every worker has loaded its
    engine, and a worker that cannot start raises
    :class:`~server.manager.worker.WorkerStartupError`. Without it the block starts at once
    and the workers come up behind it (the HTTP server does this, answering 503 meanwhile).
    ``spawn`` replaces how a worker process is started (see
    :func:`~server.manager.worker.spawn_process`); tests pass in-memory fakes.

    An exception raised in the block comes out as itself (``except ClientError`` around
    the block works; Ctrl-C is a plain ``KeyboardInterrupt``). Only when one of the engine's
    own background tasks failed does a ``BaseExceptionGroup`` come out: it holds that
    failure (and the block's exception, unless that was the cancellation it caused).
    """
    return body_errors_unwrapped(_open_engine(config, wait_ready=wait_ready, spawn=spawn))


@asynccontextmanager
async def _open_engine(
    config: EngineConfig | None, *, wait_ready: bool, spawn
) -> AsyncIterator[Engine]:
    engine = Engine(config or EngineConfig(), spawn=spawn)
    failed: list[WorkerStartupError] = []

    async def start(nursery: trio.Nursery, worker: WorkerClient) -> None:
        try:
            await nursery.start(worker.run)
        except WorkerStartupError as exc:
            failed.append(exc)
            nursery.cancel_scope.cancel()  # stop the others; raised below, unwrapped

    async with trio.open_nursery() as nursery:
        await nursery.start(engine.deadlines.run)
        if engine.discovery is not None:  # (its first answer's workers join at once)
            await nursery.start(engine.discovery.run)
        if wait_ready:
            async with trio.open_nursery() as starter:
                for w in engine.static_workers():
                    starter.start_soon(start, nursery, w)
            await engine.wait_ready()  # (discovered workers too: their service is theirs)
        else:
            for w in engine.static_workers():
                nursery.start_soon(w.run)
        if not failed:
            try:
                yield engine
            finally:
                engine.stop_accepting()
                with trio.CancelScope(shield=True):
                    await engine._abort_open_streams()
                nursery.cancel_scope.cancel()
    if failed:
        raise failed[0]


async def run_engine(
    config: EngineConfig,
    *,
    shutdown: trio.Event,
    spawn=None,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """The engine as a service: ``started(engine)`` at once (workers still loading), runs
    until ``shutdown`` is set, then stops the workers."""
    async with open_engine(config, wait_ready=False, spawn=spawn) as engine:
        task_status.started(engine)
        await shutdown.wait()

