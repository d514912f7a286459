"""A request's slow setup runs off the engine loop (server/workers/prepare.py): grammar
compilation with its budgets and cache, tokenizing huge prompts, aborts while preparing.

Two layers: the transformers engine and a :class:`Preparer` in this process (real threads, a
real engine), then real worker processes with a short heartbeat timeout: a worker whose loop
stopped for a grammar or a tokenizer would be declared hung and killed. The pipe worker's
tests share one engine (the ``shared`` fixture), which none of them changes: a worker and its
helper process both import torch, tens of seconds of CPU to start, more than the tests.
"""

from __future__ import annotations

import json
import selectors

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("xgrammar")

import torch  # noqa: E402
import trio  # noqa: E402

import server  # noqa: E402
from server import SamplingParams  # noqa: E402
from server.workers.base import Rejected  # noqa: E402
from server.engines.transformers.engine import TransformersEngine  # noqa: E402
from server.worker_protocol import wire  # noqa: E402
from server.workers.prep_helper import PROCESS_BYTES  # noqa: E402
from server.workers.prepare import Preparer  # noqa: E402
from tests.conftest import ThreadServer, assert_engine_idle  # noqa: E402
from tests.test_transformers_engine import collect  # noqa: E402
from tests.tiny_model import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow  # (vLLM or transformers start-ups: run first under -n)

torch.set_num_threads(1)

LIMIT = 300  # a hang guard: 3.5 MB tokenizes took 76-84 s on 2 cores kept busy by bench/cpu_load.py
#: A worker silent this long is declared hung and killed: shorter than the loop would stop
#: for the heavy work below (a 4,000-property schema: 6-8 s here, a 1.5 MB one-word prompt:
#: ~3 s) if it ran on the loop; 15 times the heartbeat and the pulse's period (0.1 s).
HEARTBEAT = 1.5


def wide_schema(n: int = 4000, prefix: str = "p") -> dict:
    """An ordinary schema that takes seconds to compile: n required string properties."""
    names = [f"{prefix}{i}" for i in range(n)]
    return {"type": "object", "properties": {k: {"type": "string"} for k in names},
            "required": names}


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "schema": schema}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("prep") / "tiny-llama")


@pytest.fixture(scope="module")
def engine(model_dir):
    return TransformersEngine(model_path=str(model_dir), max_batch=4)


#: A prompt whose tokenizing takes seconds (~3 s quiet, ~2 µs a character), longer than
#: HEARTBEAT: a worker that tokenized it on its loop would be declared hung. Past the size
#: tokenized in the worker's helper process (PROCESS_BYTES), and its answer (a token id a
#: character here) past wire.BIG_FRAME, sent in PART frames: the paths of any bigger one.
HUGE_PROMPT = "a" * 1_500_000


@pytest.fixture(scope="module")
def huge_prompt_tokens(engine) -> dict:
    """This process's answer for HUGE_PROMPT, that the workers' must equal: tokenized once
    for the module."""
    assert len(HUGE_PROMPT) > PROCESS_BYTES
    answer = engine.tokenize({"op": "tokenize", "prompt": HUGE_PROMPT})
    assert len(answer["tokens"]) > wire.BIG_FRAME  # (msgpack: a byte or more an id)
    return answer


#: A prompt whose /tokenize answer is 1.1M ids (one byte of msgpack an id: over a MiB).
BIG_PROMPT = "x" * 1_100_000


@pytest.fixture(scope="module")
def big_prompt_ids(model_dir) -> list[int]:
    """BIG_PROMPT's ids by the model's tokenizer in this process, loaded apart from the
    engine's."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))(BIG_PROMPT)["input_ids"]


def wait_collect(preparer: Preparer, accepts: list, outputs: list, until) -> list:
    """Wait on the preparer's wake-up descriptor and collect, until ``until(replies)``."""
    replies: list = []
    with selectors.DefaultSelector() as selector:
        selector.register(preparer.fileno(), selectors.EVENT_READ)
        while not until(replies):
            selector.select(5.0)
            replies += preparer.collect(accepts, outputs)
    return replies


# -- 1. in this process -------------------------------------------------------------------------


def test_compiled_grammars_are_cached_by_schema(engine):
    def schema(first: str, second: str) -> dict:  # a fresh object each time
        return {"type": "object", "required": ["a", "b"],
                "properties": {first: {"type": "integer"}, second: {"type": "string"}}}

    def add(rid: int, value: dict) -> dict:
        engine.add(rid, "hello", {"max_tokens": 4, "response_format": json_schema(value)})
        return engine.statistics()["grammars"]

    first = add(1, schema("a", "b"))
    again = add(2, schema("a", "b"))
    assert (again["hits"], again["misses"]) == (first["hits"] + 1, first["misses"])
    # the properties' order is the generated JSON's order: another grammar
    other = add(3, schema("b", "a"))
    assert (other["hits"], other["misses"]) == (again["hits"], again["misses"] + 1)
    assert engine.abort(1) and engine.abort(2) and engine.abort(3)


def test_schema_budgets_refuse_naming_response_format_or_the_tool(model_dir):
    small = TransformersEngine(model_path=str(model_dir), max_batch=2, grammar_timeout=0.05)
    try:
        huge = wide_schema(8000)  # over the default limit of 256 KiB of JSON
        with pytest.raises(Rejected, match=r"^response_format: .*too large.*262144") as info:
            small.add(1, "hi", {"max_tokens": 2, "response_format": json_schema(huge)})
        assert info.value.kind == "invalid_request"
        forced = {**json_schema(huge), "origin": "tool_choice"}
        with pytest.raises(Rejected, match=r"^tool_choice \(the forced tool call"):
            small.add(2, "hi", {"max_tokens": 2, "response_format": forced})
        # within the size limit, but it takes seconds to compile, more than 50 ms
        slow = json_schema(wide_schema(2000, "slow"))
        assert len(json.dumps(slow)) < 262144
        with pytest.raises(Rejected, match=r"^response_format: .*did not compile within .* 0.05 s"):
            small.add(3, "hi", {"max_tokens": 2, "response_format": slow})
        assert small.statistics()["grammars"]["timeouts"] == 1
        assert small.next_deadline() is None
    finally:
        small.close()


def test_an_abort_while_preparing_answers_once_and_drops_the_late_result(engine):
    preparer = Preparer(engine)
    accepts: list = []
    outputs: list = []
    try:
        heavy = {"max_tokens": 4, "response_format": json_schema(wide_schema(600, "abort"))}
        preparer.submit(7, "hello", heavy)
        assert preparer.preparing() == 1 and engine.waiting() == 0  # holds no batch slot
        assert preparer.abort(7)
        assert not preparer.abort(7)  # answered once: a second abort finds nothing
        preparer.submit(7, "hello again", {"max_tokens": 3})  # the id, resubmitted
        wait_collect(preparer, accepts, outputs,
                     lambda _: preparer.statistics()["dropped_total"] == 1 and accepts)
        prompt_tokens = len(engine.encode("hello again"))
        assert [list(a) for a in accepts] == [[7, prompt_tokens]] and outputs == []
        assert engine.waiting() == 1 and preparer.preparing() == 0
        assert engine.abort(7)
    finally:
        preparer.close()


def test_tokenize_in_the_preparer_answers_with_the_same_result(engine):
    preparer = Preparer(engine)
    try:
        request = {"op": "tokenize", "prompt": "hello world " * 1000}
        preparer.tokenize(5, request)
        replies = wait_collect(preparer, [], [], bool)
        assert replies == [[8, 5, engine.tokenize(request), None]]
    finally:
        preparer.close()


def test_a_prompt_too_long_to_fit_is_refused_before_tokenizing(engine):
    longest = max(len(t.encode()) for t in engine.tokenizer.get_vocab())
    limit = engine.max_model_len * longest
    for prompt in ("a" * (limit + 1), {"messages": [{"role": "user", "content": "é" * limit}]}):
        with pytest.raises(Rejected, match=r"maximum context length is 256 tokens. However, "
                                           r"your prompt has \d+ bytes of text") as info:
            engine.add(1, prompt, {"max_tokens": 1})
        assert info.value.kind == "invalid_request"
    # at the bound, it is tokenized, and refused (or not) by its count as before
    with pytest.raises(Rejected, match=r"you requested \d+ tokens \(\d+ in the prompt"):
        engine.add(1, "a" * limit, {"max_tokens": 1})
    assert engine.next_deadline() is None


# -- 2. real worker processes -------------------------------------------------------------------


def config(model_dir) -> server.EngineConfig:
    """A worker that is killed if it does not answer a heartbeat for HEARTBEAT seconds. Its
    helper process (where the heavy work goes) at the worker's priority, not 10 below: on
    busy cores a niced helper waited its turn for minutes (its start and its work), which
    this test is not about."""
    return server.EngineConfig(
        engine="transformers",
        engine_options={"model_path": str(model_dir), "num_threads": 1,
                        "prepare_process_nice": 0},
        heartbeat_interval=0.1, heartbeat_timeout=HEARTBEAT, drain_timeout=5.0,
        startup_timeout=LIMIT,
    )


class _ThreadEngine(ThreadServer):
    """An engine (:func:`server.open_engine`) in a thread with a Trio run of its own, as
    :class:`~tests.conftest.ThreadServer` holds a server: it outlives a test's Trio run.
    A test runs its checks in the engine's run with :meth:`run`."""

    async def _serve(self, config, server_options) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with server.open_engine(config) as engine:
            self.engine = engine
            self._started.set()
            await self._stop.wait()

    async def run(self, async_fn):
        """``await async_fn(engine)`` in the engine's Trio run, under a hang guard."""

        async def guarded():
            with trio.fail_after(LIMIT):
                return await async_fn(self.engine)

        return await trio.to_thread.run_sync(self.call, guarded)

    def assert_idle(self) -> None:
        self.call(assert_engine_idle, self.engine)


@pytest.fixture(scope="module")
def _shared_engine(model_dir, huge_prompt_tokens, big_prompt_ids):
    # (started after the references are made: tokenizing megabytes here holds this process
    # for seconds, and the engine's frontend is a thread of this process, late meanwhile)
    engine = _ThreadEngine(config(model_dir), timeout=LIMIT)
    yield engine
    engine.close()


@pytest.fixture
def shared(_shared_engine):
    """One worker of :func:`config` for this module's pipe tests, checked idle after each
    test: ``await shared.run(fn)`` calls ``fn(engine)`` in its Trio run."""
    _shared_engine.check_running()
    yield _shared_engine
    _shared_engine.assert_idle()


def _stream_reference(engine) -> tuple[str, int, str | None]:
    engine.add(1, "once upon a time", {"max_tokens": 40, "temperature": 0, "ignore_eos": True})
    outs: list = []
    while engine.next_deadline() is not None:
        outs += engine.step(0.0)
    return "".join(o[1] for o in outs), sum(o[2] for o in outs), outs[-1][3]


async def _alongside(shared: _ThreadEngine, engine, heavy) -> None:
    """A greedy stream runs while ``heavy(hf)`` runs on the shared worker: the worker stays
    (same pid, no restart) and the stream's text is the whole reference text."""
    expected = _stream_reference(engine)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    async def check(hf) -> None:
        before = hf.statistics().workers[0]
        got = []

        async def stream():
            got.append(await collect(hf, "once upon a time", params))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(heavy, hf)
            nursery.start_soon(stream)
        assert got == [expected]
        worker = hf.statistics().workers[0]
        assert (worker.pid, worker.restarts) == (before.pid, 0)
        assert await hf.ping_all() == [(0, 0)]

    await shared.run(check)


async def test_a_heavy_schema_compiles_off_the_loop(shared, engine):
    results = []

    async def heavy(hf):
        params = SamplingParams(max_tokens=4, temperature=0)
        params.extra["response_format"] = json_schema(wide_schema())
        try:
            results.append(await collect(hf, "hello", params))
        except server.ClientError as exc:  # over the time budget: a 400 that says so
            assert str(exc).startswith("response_format:"), exc
            results.append("refused")

    await _alongside(shared, engine, heavy)
    assert results and (results[0] == "refused" or results[0][2] in ("stop", "length"))


async def test_a_huge_prompt_to_tokenize_does_not_stop_the_loop(shared, engine,
                                                                  huge_prompt_tokens):
    counted = []

    async def heavy(hf):
        counted.append(await hf.tokenize({"op": "tokenize", "prompt": HUGE_PROMPT}))

    await _alongside(shared, engine, heavy)
    assert counted[0]["tokens"] == huge_prompt_tokens["tokens"]


async def test_a_big_tokenize_answer_comes_whole_through_the_frontend(shared, big_prompt_ids):
    """A real worker answers a /tokenize of 1.1M ids (a RESULT frame over
    wire.BIG_FRAME, its ids packed, which the frontend decodes beside its router): the ids
    are the tokenizer's, and a stream on the same worker runs beside it to its end."""
    expected = big_prompt_ids
    assert len(wire.encode([wire.RESULT, 1, {"tokens": expected}, None])) > wire.BIG_FRAME

    async def check(hf) -> None:
        assert hf.workers[0].reads_packed  # (so the answer comes packed: 4 bytes an id)
        got: list = []
        async with trio.open_nursery() as nursery:

            async def tokenize() -> None:
                got.append(await hf.tokenize({"op": "tokenize", "prompt": BIG_PROMPT}))

            nursery.start_soon(tokenize)
            params = server.SamplingParams(max_tokens=8, ignore_eos=True)
            async with hf.generate("hello", params) as stream:
                outs = [out async for out in stream]
        assert outs[-1].finish_reason == "length"
        assert got[0]["tokens"] == expected

    await shared.run(check)


async def test_a_listening_worker_prepares_off_its_loop_too(model_dir, engine, tmp_path,
                                                            huge_prompt_tokens):
    from tests.remote import listening_worker, wait_until

    expected = _stream_reference(engine)
    path = tmp_path / "w.sock"
    args = ["--engine", "transformers", "--model-path", str(model_dir), "--num-threads", "1"]
    async with listening_worker(tmp_path, f"unix:{path}", *args, secret=None,
                                startup=LIMIT) as w:
        remote = server.EngineConfig(
            worker_addresses=(w.address,), workers=1, shutdown_grace=0.3,
            heartbeat_interval=0.1, heartbeat_timeout=HEARTBEAT)
        with trio.fail_after(LIMIT):
            async with server.open_engine(remote) as hf:
                got: list = []

                async def stream():
                    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
                    got.append(await collect(hf, "once upon a time", params))

                async def count():
                    got.append(await hf.tokenize({"op": "tokenize", "prompt": HUGE_PROMPT}))

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(count)
                    nursery.start_soon(stream)
                assert sorted(got, key=str) == sorted([expected, huge_prompt_tokens], key=str)
                assert hf.statistics().workers[0].restarts == 0
        # (the worker logs the frontend's leaving once it sees the connection close)
        await wait_until(lambda: "disconnected" in w.text(), 30)
        assert "Traceback" not in w.text()
