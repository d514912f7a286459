"""Migration end to end (issue 24 item 3): real sim worker processes, one SIGKILLed (or
crashed) mid-stream; its streams go on on another worker with the text an uninterrupted run
gives, each token counted once. Frames are recorded on the pipes (tests/fakes.py
``RecordingSpawner``), so resumes and aborts are counted on the wire. No timing bounds."""

from __future__ import annotations

import json
import os
import signal

import httpx
import openai
import trio

from server import SamplingParams
from server.worker_protocol import wire
from tests.conftest import running_server
from tests.fakes import (
    all_outputs,
    fault,
    open_real_engine,
    sim_config,
    sim_reference,
    wait_for,
)

FAST = dict(itl_ms=2.0, ttft_ms=2.0, prefill_us_per_token=0.0, drain_timeout=0.5,
            shutdown_grace=1.0)
LIMIT = 60


def config(**kw):
    return sim_config(**{**FAST, **kw})


def resumes(spawn, rid: int | None = None) -> list:
    """The SUBMIT frames that resumed a request (``rid``'s, or any)."""
    return [f for f in spawn.submits()
            if "resume" in f.msg[3] and (rid is None or f.msg[1] == rid)]


def kill_worker(engine, index: int) -> None:
    pid = engine.statistics().workers[index].pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)


#: Greedy, greedy with stop strings that hold text back, and seeded sampling: all resume
#: exactly on the sim (docs/routing.md).
CASES = [
    ("one", SamplingParams(max_tokens=300, temperature=0)),
    ("two", SamplingParams(max_tokens=300, temperature=0, stop=["model token zzz", " a b"])),
    ("three", SamplingParams(max_tokens=300, temperature=0.8, seed=11)),
    ("four", SamplingParams(max_tokens=300, temperature=0, n=2)),
]


async def test_sigkilled_worker_streams_go_on_with_the_uninterrupted_text():
    with trio.fail_after(LIMIT):
        async with open_real_engine(config(workers=2, routing="round-robin")) as (
                engine, spawn):
            streams = {name: engine.generate(name, params) for name, params in CASES}
            results: dict[str, list] = {}

            async def consume(name, stream):
                async with stream:
                    results[name] = await all_outputs(stream)

            async with trio.open_nursery() as nursery:
                for name, stream in streams.items():
                    nursery.start_soon(consume, name, stream)
                doomed = [s for s in streams.values()
                          if s.choice_states()[0].worker.index == 0]
                assert doomed
                await wait_for(lambda: all(c.completion_tokens >= 3 for s in doomed
                                           for c in s.choice_states()), timeout=LIMIT)
                kill_worker(engine, 0)
            moved = sum(len(s.choice_states()) for s in doomed)
            stats = engine.statistics().migration
            assert stats is not None and stats.migrations["exited"] == moved
            assert len(resumes(spawn)) == moved
            for name, params in CASES:
                outs = results[name]
                for i in range(params.n):
                    mine = [o for o in outs if o.index == i]
                    text, ntok, finish = sim_reference(name, params, i)
                    assert mine[-1].finish_reason == finish
                    assert mine[-1].error_kind is None, mine[-1].error
                    assert "".join(o.text for o in mine) == text, name
                    assert mine[-1].completion_tokens == ntok  # each token counted once
                    assert mine[-1].prompt_tokens == 1  # the client's prompt, not the resumed one
            # the resumed requests went to the live worker, with the tokens made before
            live = engine.statistics().workers[1].pid
            for frame in resumes(spawn):
                assert frame.pid == live
                params = frame.msg[3]
                assert params["max_tokens"] == 300 - len(params["resume"]["token_ids"])


async def test_a_paced_stream_moves_with_its_wakeups():
    """With a stream interval, the moved stream's wakeups come from the new worker's
    pacer (the dead one's router is gone), and its text is the uninterrupted run's."""
    params = SamplingParams(max_tokens=200, temperature=0)
    with trio.fail_after(LIMIT):
        async with open_real_engine(config(workers=2, stream_interval=0.02)) as (engine, _):
            async with engine.generate("paced", params) as stream:
                [choice] = stream.choice_states()
                first = choice.worker
                text = ""
                async for out in stream:
                    text += out.text
                    if choice.migrations == 0 and out.completion_tokens >= 3:
                        kill_worker(engine, first.index)
                        await wait_for(lambda: choice.migrations == 1, timeout=LIMIT)
                        assert choice.waker.pacer is choice.worker.pacer is not first.pacer
    assert text == sim_reference("paced", params)[0] and out.completion_tokens == 200


async def test_usage_and_text_over_http_when_a_worker_is_killed():
    """Through hypercorn and the openai SDK: the stream ends normally, its text is the
    uninterrupted run's, usage counts each token once, and /metrics counts the migration."""
    params = SamplingParams(max_tokens=200, temperature=0)
    expected, ntok, _ = sim_reference("hello there", params)
    with trio.fail_after(LIMIT):
        async with running_server(config(workers=2)) as url:
            engine = url.app.engine
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            stream = await client.completions.create(
                model="sim", prompt="hello there", max_tokens=200, temperature=0, stream=True,
                stream_options={"include_usage": True})
            text = ""
            usage = None
            killed = False
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    assert chunk.choices[0].finish_reason in (None, "length")
                if chunk.usage is not None:
                    usage = chunk.usage
                if not killed and len(text.split()) >= 5:
                    [state] = [s for st in list(engine._streams) for s in st.choice_states()]
                    kill_worker(engine, state.worker.index)
                    killed = True
            metrics = (await client._client.get(url + "/metrics")).text
            await client.close()
    assert killed and text == expected
    assert usage is not None and usage.completion_tokens == ntok and usage.prompt_tokens == 2
    assert 'trio_llm:migrations_total{cause="exited",model_name="sim"} 1.0' in metrics


async def test_max_migrations_0_ends_the_streams_with_the_worker_died_error():
    with trio.fail_after(LIMIT):
        async with open_real_engine(config(workers=2, max_migrations=0)) as (engine, spawn):
            async with engine.generate("x", SamplingParams(max_tokens=2000)) as stream:
                stream.errors_as_outputs = True
                index = stream.choice_states()[0].worker.index
                outs = []
                async for out in stream:
                    outs.append(out)
                    if len(outs) == 3:
                        kill_worker(engine, index)
            assert (outs[-1].finish_reason, outs[-1].error_kind) == ("error", "worker_died")
            assert not resumes(spawn) and engine.statistics().migration is None


async def test_no_other_worker_gives_the_error_event_and_done():
    """One worker: nowhere to go. The SSE stream has today's error event, then [DONE]."""
    with trio.fail_after(LIMIT):
        async with running_server(config()) as url:
            engine = url.app.engine
            body = {"model": "sim", "prompt": "hi", "max_tokens": 2000, "stream": True}
            events = []
            async with httpx.AsyncClient() as client:
                async with client.stream("POST", url + "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            if len(events) == 3:
                                kill_worker(engine, 0)
            stats = engine.statistics().migration
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "worker_died"
    assert stats is not None and stats.failed["no_worker"] == 1 and not stats.migrations


async def test_a_request_that_kills_every_worker_stops_at_the_limit():
    """A poison request (the sim's crash fault: it crashes whichever worker runs it past
    its third token) moves once with --max-migrations 1, crashes that worker too, and ends
    with the error instead of taking down the third worker."""
    crash = SamplingParams(max_tokens=100, temperature=0, extra=fault("crash", 3))
    with trio.fail_after(LIMIT):
        async with open_real_engine(config(workers=3, max_migrations=1)) as (engine, spawn):
            stream = engine.generate("poison", crash)
            stream.errors_as_outputs = True
            outs = await all_outputs(stream)
            stats = engine.statistics().migration
            assert stats is not None
            assert stats.migrations["exited"] == 1 and stats.failed["limit"] == 1
            await wait_for(lambda: sum(w.restarts for w in engine.statistics().workers) == 2,
                           timeout=LIMIT)
    assert (outs[-1].finish_reason, outs[-1].error_kind) == ("error", "worker_died")
    assert "".join(o.text for o in outs) == sim_reference("poison", SamplingParams(
        max_tokens=3, temperature=0))[0]  # three tokens, from the first worker only
    assert len(resumes(spawn)) == 1


async def test_abort_after_the_move_reaches_the_new_worker_once():
    """The client leaves right after its request moved: one abort, to the worker that
    holds it now; nothing is left in the manager or the workers (open_real_engine)."""
    with trio.fail_after(LIMIT):
        async with open_real_engine(config(workers=2)) as (engine, spawn):
            stream = engine.generate("leave", SamplingParams(max_tokens=2000))
            [choice] = stream.choice_states()
            first = choice.worker.index
            n = 0
            async with stream:
                async for _ in stream:
                    n += 1
                    if n == 3:
                        kill_worker(engine, first)
                        await wait_for(lambda: choice.migrations == 1, timeout=LIMIT)
                        break  # the stream closes: its abort goes out
            assert choice.worker.index != first
            assert spawn.aborts(choice.rid) == 1
            [abort] = [f for f in spawn.messages(wire.ABORT) if f.msg[1] == choice.rid]
            assert abort.pid == engine.statistics().workers[choice.worker.index].pid
            assert choice.finish_reason == "abort"


async def test_a_request_being_aborted_when_its_worker_dies_ends_without_moving():
    """Its abort was sent (the worker ignores it: the sim's ignore_abort fault) and the
    worker dies before confirming: the choice ends with abort, and is not resumed."""
    params = SamplingParams(max_tokens=2000, extra=fault("ignore_abort"))
    with trio.fail_after(LIMIT):
        async with open_real_engine(config(workers=2, drain_timeout=30.0)) as (engine, spawn):
            stream = engine.generate("going", params)
            [choice] = stream.choice_states()
            n = 0
            async for _ in stream:
                n += 1
                if n == 3:
                    break
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream.aclose)
                await wait_for(lambda: spawn.aborts(choice.rid) == 1, timeout=LIMIT)
                kill_worker(engine, choice.worker.index)
            assert choice.finish_reason == "abort" and choice.migrations == 0
            assert not resumes(spawn)


async def test_a_listening_workers_end_moves_its_streams_to_the_other(tmp_path):
    """Remote workers (``--listen``): the killed one's connection ends, its stream goes on
    on the other with the uninterrupted text (token ids crossed the listening worker's
    per-connection routing as notes)."""
    from contextlib import AsyncExitStack

    import server as server_pkg
    from tests.remote import free_port, listening_worker, remote_config

    params = SamplingParams(max_tokens=400, temperature=0)
    expected = sim_reference("remote", params)[0]
    with trio.fail_after(LIMIT):
        async with AsyncExitStack() as stack:
            workers = [await stack.enter_async_context(listening_worker(
                tmp_path, f"127.0.0.1:{free_port()}", name=name)) for name in ("a", "b")]
            config = remote_config(*workers, heartbeat_interval=0.2, restart_backoff=0.05,
                                   restart_backoff_max=0.2)
            async with server_pkg.open_engine(config) as engine:
                async with engine.generate("remote", params) as stream:
                    [choice] = stream.choice_states()
                    text = ""
                    async for out in stream:
                        text += out.text
                        if out.completion_tokens >= 3 and choice.migrations == 0:
                            workers[choice.worker.index].proc.send_signal(signal.SIGKILL)
                            with trio.fail_after(LIMIT):
                                while choice.migrations == 0:
                                    await trio.sleep(0.01)
                stats = engine.statistics().migration
    assert out.finish_reason == "length" and out.completion_tokens == 400
    assert text == expected
    assert stats is not None and stats.migrations["disconnected"] == 1


# -- the sim's resume, sans-IO: every cut gives the uninterrupted run -------------------------


def _run_sim(params: dict, cut: int | None = None, **options) -> tuple[str, int, str, list]:
    """One request on a sim engine (fake clock); at ``cut`` tokens, a fresh engine resumes
    it from what a frontend has: the token ids, the text's length, the tokens left."""
    from server.engines.sim.engine import SimEngine

    class Clock:
        t = 0.0

        def __call__(self) -> float:
            return self.t

    clock = Clock()
    engine = SimEngine(clock=clock, **options)
    engine.add(1, "hello there world", {**params, "token_ids": True})
    text, ids, n, finish = "", [], 0, None
    while finish is None:
        deadline = engine.next_deadline()
        assert deadline is not None
        clock.t = deadline
        outs = engine.step(clock.t)
        for _, note in engine.notes:
            ids += note.get("token_ids", [])
        engine.notes.clear()
        for out in outs:
            text += out.text
            n += out.ntok
            finish = out.finish
        if cut is not None and n >= cut and finish is None:
            engine = SimEngine(clock=clock, **options)
            resume = {"token_ids": list(ids), "text_chars": len(text)}
            engine.add(1, "hello there world", {**params, "token_ids": True, "resume": resume,
                                                "max_tokens": params["max_tokens"] - n})
            cut = None
    return text, n, finish, ids


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"q": {}}}}}]


def test_sim_resumes_exactly_at_every_cut():
    cases = [
        ({"max_tokens": 24, "temperature": 0}, {}),
        ({"max_tokens": 24, "temperature": 1.0, "seed": 5}, {}),
        # stop strings whose start is held back across the cut (the text has "fox heavy
        # reads trio stream" and "dog quick three event"), one that stops, ones that do not
        ({"max_tokens": 24, "temperature": 0, "stop": [" fox heavy reads trio XYZ"]}, {}),
        ({"max_tokens": 24, "temperature": 0, "stop": [" three event"]}, {}),
        ({"max_tokens": 24, "temperature": 0,
          "stop": ["dog quick three event over cancel reads brown zzz"]}, {}),
        ({"max_tokens": 20, "temperature": 0}, {"reasoning_tokens": 4}),
        ({"max_tokens": 20, "temperature": 0, "tools": TOOLS}, {}),
    ]
    for params, options in cases:
        whole = _run_sim(params, **options)
        for cut in range(1, whole[1]):
            assert _run_sim(params, cut, **options) == whole, (params, cut)
    held = _run_sim(cases[2][0])[0]
    assert held.startswith(" fox heavy reads trio stream")  # (the case holds text back)
    assert _run_sim(cases[3][0])[2] == "stop"


def test_sim_refuses_a_malformed_resume():
    from server.workers.base import Rejected
    from server.engines.sim.engine import SimEngine

    engine = SimEngine()
    for resume in ({"token_ids": ["x"], "text_chars": 0}, {"token_ids": [1]},
                   {"token_ids": [10**6], "text_chars": 0}):
        try:
            engine.add(1, "hi", {"max_tokens": 4, "resume": resume})
        except Rejected as exc:
            assert exc.kind == "engine_error" and "resume" in exc.message
        else:
            raise AssertionError(f"accepted {resume}")
