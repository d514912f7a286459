"""The sim engine, sans-IO, with a fake clock: timing, batching, determinism, stop strings,
token counts, aborts, rejections and faults."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from server.workers.base import Rejected, WorkerCrash, WorkerGarbage, WorkerHang
from server.engines.sim.engine import SimEngine, count_tokens, render_chat


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(clock: Clock | None = None, **options) -> tuple[SimEngine, Clock]:
    clock = clock or Clock()
    options.setdefault("itl_ms", 10.0)
    options.setdefault("ttft_ms", 20.0)
    return SimEngine(clock=clock, **options), clock


def run(engine: SimEngine, clock: Clock, limit: int = 100_000) -> list[tuple[float, list]]:
    """Step at each deadline until idle; ``(time, output)`` for every output."""
    got = []
    for _ in range(limit):
        deadline = engine.next_deadline()
        if deadline is None:
            return got
        clock.t = max(clock.t, deadline)
        got.extend((clock.t, out) for out in engine.step(clock.t))
    raise AssertionError("the engine never went idle")


def texts(outputs) -> dict[int, str]:
    result: dict[int, str] = {}
    for _, (rid, text, *_rest) in outputs:
        result[rid] = result.get(rid, "") + text
    return result


def generate(prompt="a b c", **params) -> tuple[str, list]:
    engine, clock = make()
    engine.add(1, prompt, params)
    outs = run(engine, clock)
    return "".join(o[1] for _, o in outs), [o for _, o in outs]


# -- timing ----------------------------------------------------------------------------------


def test_first_token_at_ttft_plus_prefill_then_every_itl():
    engine, clock = make(Clock(5.0), itl_ms=10.0, ttft_ms=20.0, prefill_us_per_token=50.0)
    assert engine.next_deadline() is None
    assert engine.add(1, "one two three four", {"max_tokens": 5}) == 4
    first = 5.0 + 0.020 + 4 * 50e-6
    assert engine.next_deadline() == pytest.approx(first, abs=1e-12)
    assert engine.step(first - 1e-6) == []  # not before its time
    outs = run(engine, clock)
    times = [t for t, _ in outs]
    assert times[0] == pytest.approx(first, abs=1e-12)
    assert [b - a for a, b in zip(times, times[1:])] == pytest.approx([0.010] * 4, abs=1e-9)
    assert engine.next_deadline() is None  # idle: no ticks without work


def test_a_late_loop_keeps_the_cadence_from_now():
    engine, clock = make()
    engine.add(1, "a", {"max_tokens": 10})
    clock.t = engine.next_deadline()
    assert len(engine.step(clock.t)) == 1
    tick = engine.next_deadline()
    assert tick == pytest.approx(clock.t + 0.010)
    clock.t = tick + 0.5  # the loop was busy for half a second
    assert len(engine.step(clock.t)) == 1  # one token per tick, however late
    assert engine.next_deadline() == pytest.approx(clock.t + 0.010)


def test_batch_shares_ticks_one_output_per_request_per_tick():
    engine, clock = make()
    for rid in (1, 2, 3):
        engine.add(rid, "same prompt", {"max_tokens": 4})
    outs = run(engine, clock)
    by_time: dict[float, list[int]] = {}
    for t, o in outs:
        by_time.setdefault(t, []).append(o[0])
    assert len(by_time) == 4  # three requests, admitted together, advance together
    assert all(sorted(rids) == [1, 2, 3] for rids in by_time.values())


def test_max_batch_queues_fifo_and_admits_when_a_slot_frees():
    engine, clock = make(max_batch=2)
    engine.add(1, "a", {"max_tokens": 2})
    engine.add(2, "b", {"max_tokens": 5})
    engine.add(3, "c", {"max_tokens": 2})
    engine.add(4, "d", {"max_tokens": 2})
    assert (engine.running(), engine.waiting()) == (2, 2)
    outs = run(engine, clock)
    first_token = {}
    finish_time = {}
    for t, o in outs:
        first_token.setdefault(o[0], t)
        if o[3] is not None:
            finish_time[o[0]] = t
    # 3 is admitted when 1 finishes (its first token a TTFT later), 4 when 3 finishes
    assert first_token[3] == pytest.approx(finish_time[1] + 0.020 + 20e-6)
    assert first_token[4] == pytest.approx(finish_time[3] + 0.020 + 20e-6)
    assert first_token[4] > finish_time[3] and first_token[3] < first_token[4]
    assert (engine.running(), engine.waiting()) == (0, 0)
    assert {rid: len(texts(outs)[rid].split()) for rid in (1, 2, 3, 4)} == {
        1: 2, 2: 5, 3: 2, 4: 2,
    }


# -- output ----------------------------------------------------------------------------------


def test_deterministic_for_prompt_and_seed():
    a, _ = generate("hello there", max_tokens=20, seed=7)
    b, _ = generate("hello there", max_tokens=20, seed=7)
    assert a == b
    assert generate("hello there", max_tokens=20, seed=8)[0] != a
    assert generate("hello where", max_tokens=20, seed=7)[0] != a


def test_temperature_zero_ignores_the_seed():
    a, _ = generate("p q", max_tokens=10, temperature=0, seed=1)
    assert generate("p q", max_tokens=10, temperature=0, seed=2)[0] == a
    assert generate("p q", max_tokens=10, temperature=0)[0] == a


def test_no_seed_is_random():
    runs = {generate("p q", max_tokens=10)[0] for _ in range(3)}
    assert len(runs) > 1


def test_exact_token_counts_and_length_finish():
    text, outs = generate("x", max_tokens=9, seed=1)
    assert len(outs) == 9
    assert [o[2] for o in outs] == [1] * 9
    assert [o[3] for o in outs] == [None] * 8 + ["length"]
    assert all(o[4] is None for o in outs)
    assert count_tokens(text) == 9  # one word per token, each with its leading space
    assert text.startswith(" ")


def test_prompt_token_counts():
    engine, _ = make()
    assert engine.add(1, "  one two\tthree\nfour ", {}) == 4
    assert engine.add(2, [5, 6, 7], {}) == 3
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert render_chat(messages) == "<|system|> be brief\n<|user|> hi\n<|assistant|>"
    assert engine.add(3, {"messages": messages}, {}) == count_tokens(render_chat(messages)) == 6


def test_utf8_words_are_produced():
    text = "".join(generate(str(i), max_tokens=64, seed=i)[0] for i in range(8))
    assert any(ord(ch) > 0x7F for ch in text)
    text.encode("utf-8")


# -- stop strings ----------------------------------------------------------------------------


def _tokens(prompt: str, seed: int, max_tokens: int) -> list[str]:
    return [o[1] for o in generate(prompt, max_tokens=max_tokens, seed=seed)[1]]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    start=st.integers(0, 200),
    length=st.integers(1, 12),
    second=st.integers(0, 200),
)
def test_stop_strings_cut_exactly_and_never_leak(seed, start, length, second):
    tokens = _tokens("the prompt", seed, 30)
    full = "".join(tokens)
    start %= len(full)
    stop = full[start : start + length]
    other = full[second % len(full) :][:3]
    stops = [stop, other]
    # Generation stops at the first token after which some stop string is in the text; the
    # answer is the text before the earliest stop string present then.
    needed = next(k for k in range(1, 31) if any(s in "".join(tokens[:k]) for s in stops))
    prefix = "".join(tokens[:needed])
    cut = min(prefix.find(s) for s in stops if s in prefix)

    engine, clock = make()
    engine.add(1, "the prompt", {"max_tokens": 30, "seed": seed, "stop": stops})
    outs = [o for _, o in run(engine, clock)]
    emitted = ""
    for o in outs:
        emitted += o[1]
        # whatever was sent is final text: a prefix of the answer, never part of a stop
        assert full[:cut].startswith(emitted)
    assert emitted == full[:cut]
    assert all(s not in emitted for s in stops)
    assert outs[-1][3] == "stop"
    assert sum(o[2] for o in outs) == len(outs) == needed


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 8))
def test_stop_string_across_a_token_boundary(seed, k):
    tokens = _tokens("boundary", seed, 10)
    left, right = tokens[k - 1], tokens[k]
    assume(len(left) >= 3 and len(right) >= 2)
    stop = left[-2:] + right[:2]  # spans the boundary between token k and k + 1
    full = "".join(tokens)
    text, outs = generate("boundary", max_tokens=10, seed=seed, stop=[stop])
    assert text == full[: full.find(stop)]
    assert stop not in text
    assert outs[-1][3] == "stop"
    assert len(outs) <= k + 1


def test_held_back_text_is_released_when_the_stop_does_not_follow():
    tokens = _tokens("p", 3, 8)
    full = "".join(tokens)
    # begins like the end of token 2, then diverges: held back at token 2, then released
    stop = tokens[1][-2:] + "\x00"
    text, outs = generate("p", max_tokens=8, seed=3, stop=[stop])
    assert text == full
    assert outs[-1][3] == "length"
    assert outs[1][1] == tokens[1][:-2]  # the possible start was held back...
    assert outs[2][1] == tokens[1][-2:] + tokens[2]  # ...and sent with the next token


def test_held_back_text_is_flushed_at_max_tokens():
    tokens = _tokens("p", 4, 3)
    stop = tokens[2][-1] + "\x00"
    text, outs = generate("p", max_tokens=3, seed=4, stop=[stop])
    assert text == "".join(tokens)
    assert outs[-1][3] == "length"


def test_stop_string_inside_the_first_token():
    tokens = _tokens("p", 5, 4)
    text, outs = generate("p", max_tokens=4, seed=5, stop=[tokens[0][1:]])
    assert text == " " and outs[-1][3] == "stop" and len(outs) == 1


def test_empty_stop_strings_are_ignored():
    text, outs = generate("p", max_tokens=4, seed=5, stop=["", ""])
    assert outs[-1][3] == "length" and len(outs) == 4


# -- aborts ----------------------------------------------------------------------------------


def test_abort_running_waiting_and_unknown():
    engine, clock = make(max_batch=1)
    engine.add(1, "a", {"max_tokens": 100})
    engine.add(2, "b", {"max_tokens": 100})
    assert engine.abort(2) is True  # waiting
    assert engine.abort(2) is False  # gone
    assert engine.abort(99) is False  # never known
    clock.t = engine.next_deadline()
    assert len(engine.step(clock.t)) == 1
    assert engine.abort(1) is True  # running
    assert (engine.running(), engine.waiting()) == (0, 0)
    assert run(engine, clock) == []  # nothing more from aborted requests


def test_ignore_abort_fault_keeps_running():
    engine, clock = make(faults=True)
    engine.add(1, "a", {"max_tokens": 3, "fault": {"kind": "ignore_abort"}})
    assert engine.abort(1) is False
    outs = run(engine, clock)
    assert [o[3] for _, o in outs] == [None, None, "length"]


def test_aborting_during_ttft_admits_the_next_waiting_request():
    # (a regression test: abort() once left the queue stuck, next_deadline() None)
    engine, clock = make(max_batch=1)
    engine.add(1, "a", {"max_tokens": 2})
    engine.add(2, "b", {"max_tokens": 2})
    assert engine.abort(1) is True
    assert engine.next_deadline() is not None
    outs = run(engine, clock)
    assert [o[3] for _, o in outs if o[0] == 2][-1] == "length"


# -- rejections and faults -------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("a b c", {"max_tokens": 8190}, "maximum context length is 8192"),
        ("", {}, "at least one token"),
        (3.5, {}, "string or a list"),
        ([1, "x"], {}, "string or a list"),
        ({"messages": "hi"}, {}, "must be a list"),
        ({"messages": [{"role": "user"}]}, {}, "role and a content"),
        ("a", {"max_tokens": 0}, "at least 1"),
        ("a", {"max_tokens": "many"}, "malformed"),
        # (the sampling fields read as the transformers engine reads them: workers.base)
        ("a", {"temperature": -1}, "temperature must be >= 0"),
        ("a", {"top_p": 0}, "top_p must be in"),
        ("a", {"top_p": "x"}, "malformed sampling parameter 'top_p'"),
        ("a", {"seed": "x"}, "malformed sampling parameter 'seed'"),
    ],
)
def test_rejections(prompt, params, match):
    engine, _ = make()
    with pytest.raises(Rejected, match=match) as info:
        engine.add(1, prompt, params)
    assert info.value.kind == "invalid_request"
    assert (engine.running(), engine.waiting()) == (0, 0)


def test_no_max_tokens_means_what_fits_the_context():
    engine, clock = make(max_model_len=10)
    engine.add(1, "a b c", {"max_tokens": None})  # (fewer than an end of sequence's least)
    assert sum(o[2] for _, o in run(engine, clock)) == 7
    with pytest.raises(Rejected, match="maximum context length"):
        engine.add(2, "a " * 10, {"max_tokens": None})


def test_context_limit_counts_prompt_plus_max_tokens():
    engine, _ = make(max_model_len=10)
    assert engine.add(1, "a b c", {"max_tokens": 7}) == 3
    with pytest.raises(Rejected):
        engine.add(2, "a b c", {"max_tokens": 8})


def test_faults_are_ignored_unless_enabled():
    text, outs = generate("a", max_tokens=3, fault={"kind": "crash", "after": 0})
    assert outs[-1][3] == "length"
    engine, _ = make(faults=True)
    with pytest.raises(Rejected, match="fault.kind"):
        engine.add(1, "a", {"fault": {"kind": "explode"}})


def test_error_fault_after_k_tokens():
    engine, clock = make(faults=True)
    engine.add(1, "a", {"max_tokens": 10, "fault": {"kind": "error", "after": 3}})
    outs = [o for _, o in run(engine, clock)]
    assert [o[2] for o in outs] == [1, 1, 1, 0]
    assert (outs[-1].finish, outs[-1].error) == ("error", ["engine_error", "injected engine failure"])
    assert engine.running() == 0


@pytest.mark.parametrize(
    "kind, exc", [("crash", WorkerCrash), ("hang", WorkerHang), ("garbage", WorkerGarbage)]
)
def test_process_faults_raise_after_k_tokens(kind, exc):
    engine, clock = make(faults=True)
    engine.add(1, "a", {"max_tokens": 10, "fault": {"kind": kind, "after": 2}})
    produced = 0
    with pytest.raises(exc):
        while True:
            clock.t = engine.next_deadline()
            produced += len(engine.step(clock.t))
    assert produced == 2


def test_stall_fault_stops_one_request_only():
    engine, clock = make(faults=True)
    engine.add(1, "a", {"max_tokens": 10, "fault": {"kind": "stall", "after": 2}})
    engine.add(2, "b", {"max_tokens": 5})
    got: dict[int, int] = {1: 0, 2: 0}
    for _ in range(50):
        clock.t = engine.next_deadline()
        for o in engine.step(clock.t):
            got[o[0]] += 1
    assert got == {1: 2, 2: 5}
    assert engine.running() == 1
    assert engine.abort(1) is True


def test_stall_before_the_first_token():
    # (a regression test: this once raised KeyError, deleting it from _starting twice)
    engine, clock = make(faults=True)
    engine.add(1, "a", {"max_tokens": 10, "fault": {"kind": "stall", "after": 0}})
    for _ in range(5):
        clock.t = engine.next_deadline()
        assert engine.step(clock.t) == []
    assert engine.abort(1) is True
