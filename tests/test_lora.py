"""LoRA adapters without vLLM: the worker's adapter table (sans-IO), the options, the wire,
the sim engine's simulated adapters, and what a server whose engine has no adapters
answers. (With vLLM: test_vllm_lora.py; a worker that joins by DNS:
test_discovery_lora.py.)"""

from __future__ import annotations

import argparse

import httpx
import pytest

from server.cli import build_parser, config_from_args
from server.engine_args import add_engine_arguments, engine_options
from server.worker_protocol import wire
from server.workers.base import Rejected
from server.workers.lora import AdapterTable, parse_lora_modules
from server.workers.main import handle_message
from server.engines.sim.engine import SimEngine


@pytest.fixture
def lora_dir(tmp_path):
    root = tmp_path / "loras"
    (root / "a").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "escape").symlink_to(tmp_path / "outside")
    return root


def _rejected(call, *args) -> Rejected:
    with pytest.raises(Rejected) as info:
        call(*args)
    return info.value


def test_run_time_paths_resolve_inside_the_lora_dir(lora_dir):
    table = AdapterTable(lora_dir=str(lora_dir), allow_runtime=True)
    real = str((lora_dir / "a").resolve())
    assert table.runtime_path("a") == real
    assert table.runtime_path(str(lora_dir / "a")) == real
    for path in ("../outside", str(lora_dir.parent / "outside"), "escape", ".", "a/../.."):
        assert "outside this server's LoRA directory" in _rejected(table.runtime_path, path).message
    assert _rejected(table.runtime_path, "missing").kind == "not_found"
    for path in ("", None, 5, "a\0b"):
        assert _rejected(table.runtime_path, path).kind == "invalid_request"
    off = AdapterTable(lora_dir=str(lora_dir))
    assert "--allow-runtime-lora" in _rejected(off.runtime_path, "a").message
    with pytest.raises(ValueError, match="--lora-dir"):
        AdapterTable(allow_runtime=True)
    with pytest.raises(ValueError, match="does not exist"):
        AdapterTable(lora_dir=str(lora_dir / "nope"), allow_runtime=True)


def test_names_ids_and_a_removal_deferred_until_the_last_request_ends():
    table = AdapterTable()
    assert table.add("a", "/p/a") == (1, "/p/a", True)
    assert table.add("a", "/p/a") == (1, "/p/a", False)  # a replayed load: the same
    assert "already been loaded" in _rejected(table.add, "a", "/p/other").message
    assert _rejected(table.add, "", "/p").kind == "invalid_request"
    assert table.add("b", "/p/b")[0] == 2
    assert table.use(7, "a") == (1, "/p/a")
    assert table.use(8, "a") == (1, "/p/a")
    assert table.use(9, "b") == (2, "/p/b")
    assert _rejected(table.use, 10, "c").kind == "model_not_found"
    assert table.remove("a") == []  # requests 7 and 8 still run with it
    assert table.names() == {"b": "/p/b"}
    assert _rejected(table.use, 10, "a").kind == "model_not_found"
    assert _rejected(table.remove, "a").kind == "not_found"
    assert table.add("a", "/p/a2")[0] == 3  # the name again: a new adapter
    assert table.release(7) == []
    assert table.release(8) == [1]  # the old "a" leaves the engine now
    assert table.release(8) == []
    assert table.release(9) == []  # "b" is still served
    assert table.remove("b") == [2]


def test_lora_modules_as_vllm_takes_them():
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y"}']) == {"a": "/x", "b": "/y"}
    assert parse_lora_modules(['{"name": "b", "path": "/y", "base_model_name": "m"}']) == {
        "b": ["/y", "m"]}
    for bad, words in ((["a"], "name=path"), (["a=/x", "a=/y"], "twice"),
                       (['{"name": "b"}'], "a name and a path"), (["{nope"], "JSON"),
                       (['{"name": "b", "path": "/y", "x": 1}'], "unknown key")):
        with pytest.raises(ValueError, match=words):
            parse_lora_modules(bad)


def _options(*argv: str):
    p = argparse.ArgumentParser(prog="t")
    add_engine_arguments(p, spawned=True)
    return engine_options(p.parse_args(list(argv)), "t")


def test_options_are_refused_where_they_would_be_ignored(tmp_path, capsys):
    vllm = ("--engine", "vllm", "--model-path", str(tmp_path))
    got = _options(*vllm, "--enable-lora", "--max-loras", "2", "--lora-modules", "a=/x",
                   "b=/y", "--allow-runtime-lora", "--lora-dir", str(tmp_path))
    assert got["engine_args"] == {"enable_lora": True, "max_loras": 2}
    assert got["lora_modules"] == {"a": "/x", "b": "/y"}
    assert (got["allow_runtime_lora"], got["lora_dir"]) == (True, str(tmp_path))
    for argv, words in (
        ((*vllm, "--lora-modules", "a=/x"), "--lora-modules needs --enable-lora"),
        ((*vllm, "--max-lora-rank", "8"), "--max-lora-rank needs --enable-lora"),
        ((*vllm, "--enable-lora", "--allow-runtime-lora"), "needs --lora-dir"),
        ((*vllm, "--enable-lora", "--lora-dir", str(tmp_path)), "give --allow-runtime-lora"),
        ((*vllm, "--enable-lora", "--allow-runtime-lora", "--lora-dir", str(tmp_path / "n")),
         "no such directory"),
        (("--engine", "transformers", "--model-path", str(tmp_path), "--enable-lora"),
         "--enable-lora is an option of the vllm and sim engines"),
        (("--engine", "transformers", "--model-path", str(tmp_path), "--lora-modules",
          "a=/x"), "--lora-modules is an option of the vllm and sim engines"),
        # the sim's adapters have no weights: a rank would mean nothing
        (("--enable-lora", "--max-lora-rank", "8"),
         "--max-lora-rank is an option of the vllm engine, not of --engine sim"),
        (("--lora-modules", "a=/x"), "--lora-modules needs --enable-lora"),
        (("--max-loras", "2"), "--max-loras needs --enable-lora"),
    ):
        with pytest.raises(SystemExit, match=words):
            _options(*argv)
    sim = _options("--enable-lora", "--max-loras", "2", "--lora-modules", "a=/x",
                   "--allow-runtime-lora", "--lora-dir", str(tmp_path))
    assert {k: v for k, v in sim.items() if "lora" in k} == {
        "enable_lora": True, "max_loras": 2, "lora_modules": {"a": "/x"},
        "allow_runtime_lora": True, "lora_dir": str(tmp_path)}
    assert "enable_lora" not in _options()
    with pytest.raises(SystemExit):
        _options("--enable-lora", "--max-loras", "0")
    assert "--max-loras: expected an integer of at least 1" in capsys.readouterr().err
    # several frontends would each keep a table of their own
    with pytest.raises(SystemExit, match="--allow-runtime-lora is not an option of --api-"):
        config_from_args(build_parser().parse_args(
            ["--api-servers", "2", *vllm, "--enable-lora", "--allow-runtime-lora",
             "--lora-dir", str(tmp_path)]))


def test_submit_carries_an_adapter_name_and_an_engine_without_adapters_404s_it():
    assert wire.check_request([wire.SUBMIT, 1, "hi", {}, "ad"])
    for bad in ([wire.SUBMIT, 1, "hi", {}, 5], [wire.SUBMIT, 1, "hi", {}, "ad", "x"]):
        with pytest.raises(wire.ProtocolError):
            wire.check_request(bad)
    engine = SimEngine(ttft_ms=0, itl_ms=0)
    accepts: list = []
    outputs: list = []
    handle_message(engine, [wire.SUBMIT, 1, "hi", {"max_tokens": 2}, "ad"], accepts, outputs)
    assert accepts == [] and outputs == [
        (1, "", 0, "error", ["model_not_found", "The model 'ad' does not exist."])]
    reply = handle_message(engine, [wire.CALL, 3, {"op": "load_lora", "name": "ad",
                                                       "path": "/x"}], accepts, outputs)
    assert reply[:3] == [wire.RESULT, 3, None] and reply[3][0] == "invalid_request"
    assert "--enable-lora" in reply[3][1]


async def test_a_server_without_adapters_answers_the_endpoints_and_names(server_url):
    async with httpx.AsyncClient(base_url=server_url) as client:
        r = await client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "a"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "lora_not_enabled"
        r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "lora_not_enabled"
        r = await client.post("/v1/load_lora_adapter", json={"lora_name": "a"})
        assert r.status_code == 400 and "Both 'lora_name' and 'lora_path'" in r.text
        r = await client.post("/v1/load_lora_adapter",
                              json={"lora_name": "a", "lora_path": "a", "other": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"
        r = await client.post("/v1/completions", json={"model": "a", "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = await client.post("/v1/chat/completions", json={
            "model": "a", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = await client.get("/v1/models")
        assert [m["id"] for m in r.json()["data"]] == ["sim"]


class _Hello:
    """What the registry reads of a worker before any round trip: its HELLO info."""

    def __init__(self, lora: dict | None) -> None:
        self.info = {"lora": lora} if lora else {}
        self.alive = True


async def test_the_frontend_table_and_what_a_fresh_worker_gets_replayed():
    from server.errors import ClientError, NotFound
    from server.manager.adapters import AdapterRegistry

    off = AdapterRegistry([_Hello({"adapters": {"a": "/a"}, "runtime": False})])
    assert off.served("a") and not off.served("b") and off.names() == {"a": "/a"}
    with pytest.raises(NotFound, match="--allow-runtime-lora"):
        await off.load("b", "b", base="m")
    with pytest.raises(NotFound, match="--allow-runtime-lora"):
        await off.unload("a")
    with pytest.raises(ClientError, match="not enabled"):
        await AdapterRegistry([_Hello(None)]).load("b", "b", base="m")

    table = AdapterRegistry([_Hello({"adapters": {"a": "/a"}, "runtime": True})])
    for name, words in (("a", "already been loaded"), ("m", "conflicts with a served base")):
        with pytest.raises(ClientError, match=words):
            await table.load(name, "x", base="m")
    with pytest.raises(NotFound, match="cannot be found"):
        await table.unload("b")
    # the state a load and an unload leave (their round trips: test_vllm_lora.py)
    table._added["b"] = "b-path"
    table._removed.add("a")
    assert not table.served("a") and table.served("b") and table.names() == {"b": "b-path"}
    assert table.replay() == [{"op": "unload_lora", "name": "a"},
                              {"op": "load_lora", "name": "b", "path": "b-path"}]
    table._loading.add("b")
    assert not table.served("b") and table.replay()[1]["name"] == "b"


# -- the sim engine's simulated adapters (server.engines.sim.lora) ---------------------------


class _Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def _sim(lora_dir, **options) -> SimEngine:
    options.setdefault("lora_modules", {"a": str(lora_dir / "a")})
    return SimEngine(ttft_ms=0, itl_ms=10, clock=_Clock(), enable_lora=True,
                     allow_runtime_lora=True, lora_dir=str(lora_dir), **options)


def _answers(engine: SimEngine, order: list | None = None) -> dict[int, str]:
    """Step ``engine`` until idle: each request's text (``order``: the rids in the order
    they produced their first output)."""
    clock = engine._clock
    got: dict[int, str] = {}
    while (deadline := engine.next_deadline()) is not None:
        clock.t = max(clock.t, deadline)
        for out in engine.step(clock.t):
            if order is not None and out.rid not in got:
                order.append(out.rid)
            got[out.rid] = got.get(out.rid, "") + out.text
    return got


def _call(engine, op: dict) -> list:
    return handle_message(engine, [wire.CALL, 9, op], [], [])


def test_an_adapter_opens_the_answer_with_its_tag_and_changes_nothing_else(lora_dir):
    from server.engines.sim.lora import tag

    engine = _sim(lora_dir, reasoning_tokens=2)
    greedy = {"max_tokens": 8, "temperature": 0}
    accepts: list = []
    outputs: list = []
    handle_message(engine, [wire.SUBMIT, 1, "x y", greedy], accepts, outputs)
    handle_message(engine, [wire.SUBMIT, 2, "x y", greedy, "a"], accepts, outputs)
    handle_message(engine, [wire.SUBMIT, 3, "x y", greedy, "nope"], accepts, outputs)
    assert [a[0] for a in accepts] == [1, 2]
    assert outputs == [(3, "", 0, "error", ["model_not_found",
                                            "The model 'nope' does not exist."])]
    got = _answers(engine)
    think = got[1].index("</think>") + len("</think>")  # (the tag opens the answer)
    assert got[2] == got[1][:think] + tag("a") + got[1][think:]
    # a JSON answer stays whole
    engine = _sim(lora_dir)
    fmt = {**greedy, "response_format": {"type": "json_object"}}
    engine.add(4, "x y", fmt)
    engine.add(5, "x y", {**fmt, "lora": "a"})
    got = _answers(engine)
    assert got[5] == got[4]


def test_the_sim_checks_adapter_paths_as_vllm_does_and_replays_idempotently(lora_dir):
    with pytest.raises(ValueError, match="no adapter directory"):
        _sim(lora_dir, lora_modules={"m": str(lora_dir / "missing")})
    with pytest.raises(ValueError, match="base_model_name 'other'"):
        _sim(lora_dir, lora_modules={"m": [str(lora_dir / "a"), "other"]})
    with pytest.raises(ValueError, match="enable_lora"):
        SimEngine(lora_modules={"a": str(lora_dir / "a")})
    with pytest.raises(ValueError, match="the sim engine's max_loras need enable_lora"):
        SimEngine(max_loras=2)  # (not ignored: a library's options are checked as the CLI's)
    engine = _sim(lora_dir)
    assert engine.info["lora"] == {"adapters": {"a": str((lora_dir / "a").resolve())},
                                   "max_loras": 1, "runtime": True}
    (lora_dir / "b").mkdir()
    load = {"op": "load_lora", "name": "b", "path": "b"}
    assert _call(engine, load)[2] == {"name": "b", "path": "b", "loaded": True}
    assert _call(engine, load)[2]["loaded"] is False  # a replayed load: the same
    (lora_dir / "b").rmdir()
    fresh = _sim(lora_dir)  # a worker that joins after the files went
    reply = _call(fresh, load)
    assert reply[2] is None and reply[3][0] == "not_found"
    assert _call(fresh, {"op": "unload_lora", "name": "a"})[2] == {"name": "a"}
    assert _call(fresh, {"op": "unload_lora", "name": "a"})[3][0] == "not_found"
    off = SimEngine(enable_lora=True, lora_modules={"a": str(lora_dir / "a")})
    for op in (load, {"op": "unload_lora", "name": "a"}):
        assert "--allow-runtime-lora" in _call(off, op)[3][1]


def test_an_unloaded_adapter_serves_its_running_requests_to_their_end(lora_dir):
    from server.engines.sim.lora import tag

    engine = _sim(lora_dir)
    engine.add(1, "x", {"max_tokens": 4, "temperature": 0, "lora": "a"})
    engine.add(2, "x", {"max_tokens": 4, "temperature": 0, "lora": "a"})
    assert engine.abort(2)
    assert _call(engine, {"op": "unload_lora", "name": "a"})[2] == {"name": "a"}
    with pytest.raises(Rejected, match="does not exist"):
        engine.add(3, "x", {"max_tokens": 4, "lora": "a"})
    assert _answers(engine)[1].startswith(tag("a"))
    assert engine.adapters.table.in_use() == {}  # (every hold ended)


def test_at_most_max_loras_adapters_run_at_once_and_others_pass_a_waiting_one(lora_dir):
    (lora_dir / "b").mkdir()
    modules = {"a": str(lora_dir / "a"), "b": str(lora_dir / "b")}
    for max_loras, first in ((1, [1, 3, 4]), (2, [1, 2, 3, 4])):
        engine = _sim(lora_dir, lora_modules=modules, max_loras=max_loras)
        for rid, adapter in ((1, "a"), (2, "b"), (3, None), (4, "a")):
            engine.add(rid, "x", {"max_tokens": 3, **({"lora": adapter} if adapter else {})})
        assert engine.running() == len(first)
        order: list = []
        _answers(engine, order)
        assert order[:len(first)] == first and sorted(order) == [1, 2, 3, 4]
        assert engine._batch_loras == {}


def test_an_adapters_prefix_cache_blocks_are_its_own(lora_dir):
    engine = _sim(lora_dir, prefix_cache_tokens=64, prefix_block_size=2)
    prompt = "w " * 9
    for rid, adapter in ((1, None), (2, "a"), (3, "a"), (4, None)):
        engine.add(rid, prompt, {"max_tokens": 1, **({"lora": adapter} if adapter else {})})
        _answers(engine)
    assert engine.notes == [[1, {"cached_tokens": 0}], [2, {"cached_tokens": 0}],
                            [3, {"cached_tokens": 8}], [4, {"cached_tokens": 8}]]


def test_a_resumed_adapter_request_goes_on_as_the_uninterrupted_one(lora_dir):
    from tests.test_migration import _run_sim

    options = {"enable_lora": True, "lora_modules": {"a": str(lora_dir / "a")}}
    for params in ({"max_tokens": 12, "temperature": 0, "lora": "a"},
                   {"max_tokens": 12, "temperature": 0, "lora": "a", "stop": [" [a] zz"]}):
        whole = _run_sim(params, **options)
        assert whole[0].startswith(" [a]")
        for cut in range(1, whole[1]):
            assert _run_sim(params, cut, **options) == whole, (params, cut)
