"""``--api-servers N``: a supervisor, N frontends on one inherited listening socket and the
engine workers, as real processes (real time, ``trio.fail_after``).

Requests spread over the frontends (counted from each frontend's own metrics, read on its
private socket), ``/metrics`` sums them; a SIGKILLed frontend's streams end, its requests
are aborted in the worker (the worker's own count, by PING), the other frontend's streams
go on untouched, and it is restarted; SIGTERM drains every frontend and leaves no process;
a SIGKILLed supervisor leaves no process (the parent-death signal); a worker that cannot
start ends the supervisor with one line; a worker killed past its restart budget is
restarted at the capped backoff while the frontends serve on. The sans-IO parts (merging expositions, the
restart policy, the split of the command line) are tested without processes.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import httpx
import pytest
import trio

from server.cli import build_parser, config_from_args
from server.observability.merge import merge_expositions
from server.restarts import Restart, Restarts
from server.supervisor_plan import plan
from tests.conftest import pid_exists
from tests.remote import local_metrics, parse_samples, supervised, worker_counts
from tests.sse_record import SSE, stream_into

LENGTH = ("trio_llm:request_success_total",
          frozenset({("finished_reason", "length"), ("model_name", "sim")}))


def in_flight(index: int | None = None) -> tuple:
    """The in-flight gauge's key: merged (labelled with the frontend), or one's own."""
    labels = {("model_name", "sim")}
    if index is not None:
        labels.add(("frontend", str(index)))
    return ("trio_llm:num_requests_in_flight", frozenset(labels))


async def wait_gone(pids, timeout: float) -> None:
    with trio.fail_after(timeout):
        while any(pid_exists(p) for p in pids):
            await trio.sleep(0.05)


async def streams(http: httpx.AsyncClient, n: int, max_tokens: int, nursery) -> list[SSE]:
    recs = [SSE() for _ in range(n)]

    async def one(rec: SSE) -> None:
        try:
            await stream_into(http, {"prompt": "p", "max_tokens": max_tokens}, rec)
        except (httpx.RemoteProtocolError, httpx.ReadError):
            rec.status = -1  # the connection broke (its frontend died)

    for rec in recs:
        nursery.start_soon(one, rec)
    with trio.fail_after(30):
        for rec in recs:
            await rec.started.wait()
    return recs


def new_connections() -> httpx.Limits:
    return httpx.Limits(max_keepalive_connections=0)  # a connection per request


# -- with processes --------------------------------------------------------------------------


async def test_requests_spread_over_the_frontends_and_metrics_sum_them(tmp_path):
    async with supervised(tmp_path) as sup:
        directory = sup.directory()
        async with httpx.AsyncClient(base_url=sup.url, timeout=30,
                                     limits=new_connections()) as http:
            async with trio.open_nursery() as nursery:
                recs = await streams(http, 16, 100, nursery)
        assert all(r.finish_reasons() == ["length"] for r in recs)
        own = [await local_metrics(directory, i) for i in (0, 1)]
        served = [m[LENGTH] for m in own]
        assert all(n > 0 for n in served) and sum(served) == 16, served
        async with httpx.AsyncClient(base_url=sup.url) as http:
            merged = parse_samples((await http.get("/metrics")).text)
        assert merged[LENGTH] == 16  # summed
        assert merged[("trio_llm:api_servers_scraped", frozenset())] == 2
        tokens = ("trio_llm:generation_tokens_total", frozenset({("model_name", "sim")}))
        assert merged[tokens] == 1600
        assert merged[in_flight(0)] == 0 and merged[in_flight(1)] == 0  # per frontend
        cpu = ("process_cpu_seconds_total", frozenset())
        assert merged[cpu] >= max(m[cpu] for m in own)  # summed too


async def test_frontends_over_remote_workers_start_none_and_leave_them_running(tmp_path):
    """--api-servers with --worker-address: the frontends share workers someone else runs
    (a frontend pod using more than one core); the supervisor starts and stops none."""
    from tests.remote import SECRET, listening_worker

    async with listening_worker(tmp_path) as w:
        async with supervised(tmp_path, "--worker-address", str(w.address), sim=False,
                              secret=SECRET) as sup:
            assert "1 engine workers, remote" in sup.text()
            directory = sup.directory()
            async with httpx.AsyncClient(base_url=sup.url, timeout=30,
                                         limits=new_connections()) as http:
                async with trio.open_nursery() as nursery:
                    recs = await streams(http, 16, 50, nursery)
            assert all(r.finish_reasons() == ["length"] for r in recs)
            served = [(await local_metrics(directory, i))[LENGTH] for i in (0, 1)]
            assert all(n > 0 for n in served) and sum(served) == 16, served
            assert w.text().count("connected") >= 2  # one connection per frontend
            sup.proc.send_signal(signal.SIGTERM)
            with trio.fail_after(20):
                assert await sup.proc.wait() == 0, sup.text()
        assert w.proc.poll() is None  # not the supervisor's to stop
        assert "worker" not in " ".join(
            line for line in sup.text().splitlines() if "stopped" in line)


async def test_a_killed_frontend_is_restarted_its_requests_aborted_the_others_untouched(tmp_path):
    async with supervised(tmp_path, "--sim-itl-ms", "5") as sup:
        directory = sup.directory()
        frontends, _ = sup.children()
        async with httpx.AsyncClient(base_url=sup.url, timeout=30,
                                     limits=new_connections()) as http:
            async with trio.open_nursery() as nursery:
                recs = await streams(http, 12, 500, nursery)  # 2.5 s each
                counts = [int((await local_metrics(directory, i))[in_flight()]) for i in (0, 1)]
                assert sum(counts) == 12 and min(counts) > 0, counts
                assert await worker_counts(directory / "worker-0.sock") == (12, 0)
                doomed = frontends[0]
                os.kill(doomed, signal.SIGKILL)
                # its requests are aborted in the worker at once; the others run on
                with trio.fail_after(30):
                    while await worker_counts(directory / "worker-0.sock") != (counts[1], 0):
                        await trio.sleep(0.05)
        broken = [r for r in recs if r.status == -1]
        whole = [r for r in recs if r.status == 200]
        assert len(broken) == counts[0] and len(whole) == counts[1]
        assert all(r.finish_reasons() == ["length"] and r.tokens() == 500 and not r.has_error()
                   for r in whole)
        assert await worker_counts(directory / "worker-0.sock") == (0, 0)
        with trio.fail_after(30):
            while (again := sup.children()[0].get(0)) in (None, doomed):
                await trio.sleep(0.05)
            while True:
                try:
                    await local_metrics(directory, 0)
                    break
                except OSError:
                    await trio.sleep(0.05)
        assert again != doomed
        assert "frontend 0 (pid %d) exited (killed by SIGKILL); restarting" % doomed in sup.text()
        async with httpx.AsyncClient(base_url=sup.url) as http:
            merged = parse_samples((await http.get("/metrics")).text)
        assert merged[("trio_llm:api_servers_scraped", frozenset())] == 2


async def test_sigterm_drains_every_frontend_and_leaves_no_process(tmp_path):
    # 10 ms steps: the holder's 8,000 tokens would take 80 s, so the drain cannot end (and
    # the frontends stop listening) before the test has seen its 503, however slow it runs.
    async with supervised(tmp_path, "--shutdown-timeout", "120", "--sim-itl-ms", "10") as sup:
        frontends, workers = sup.children()
        assert len(frontends) == 2 and len(workers) == 1
        async with httpx.AsyncClient(base_url=sup.url, timeout=60,
                                     limits=new_connections()) as http:
            async with trio.open_nursery() as nursery:
                hold, holding = SSE(), trio.CancelScope()

                async def holder() -> None:
                    with holding:
                        await stream_into(http, {"prompt": "p", "max_tokens": 8000}, hold)

                nursery.start_soon(holder)
                with trio.fail_after(30):
                    await hold.started.wait()
                recs = await streams(http, 8, 200, nursery)
                sup.proc.send_signal(signal.SIGTERM)
                with trio.fail_after(60):
                    while True:  # new requests: 503 from whichever frontend takes them
                        r = await http.post("/v1/completions",
                                            json={"prompt": "n", "max_tokens": 2})
                        if r.status_code == 503:
                            break
                        await trio.sleep(0.02)
                assert r.json()["error"]["code"] == "shutting_down"
                holding.cancel()  # the holder's client leaves: the drain can end
        # the streams running at the signal finish whole
        assert all(r.status == 200 and r.finish_reasons() == ["length"] and r.tokens() == 200
                   for r in recs)
        with trio.fail_after(60):
            assert await sup.proc.wait() == 0, sup.text()
        await wait_gone([*frontends.values(), *workers], 10)
        assert "Traceback" not in sup.text()
        assert "engine worker 0 stopped (exit status 0)" in sup.text()  # not left to die
        assert not sup.directory().exists()


async def test_every_frontend_answers_probes_on_the_shared_probe_port(tmp_path):
    """--health-port with --api-servers: the supervisor binds the probe port too (a socket
    per frontend, SO_REUSEPORT), and each frontend serves probes on its own."""
    async with supervised(tmp_path, "--health-port", "0") as sup:
        found = re.search(r"probes \(/health, /ready\) on http://127\.0\.0\.1:(\d+) "
                          r"\(every frontend\)", sup.text())
        assert found, sup.text()
        port = int(found.group(1))
        assert f":{port}" not in sup.url
        # each frontend listens on its inherited socket of that port
        assert sup.text().count(f"probes (/health, /ready) on http://127.0.0.1:{port}\n") == 2
        async with httpx.AsyncClient(timeout=30, limits=new_connections()) as http:
            for _ in range(8):
                probe = await http.get(f"http://127.0.0.1:{port}/health")
                api = await http.get(sup.url + "/health")
                assert probe.status_code == api.status_code == 200
                assert probe.json() == api.json()
            assert (await http.get(f"http://127.0.0.1:{port}/v1/models")).status_code == 404


async def test_a_killed_supervisor_leaves_no_process(tmp_path):
    async with supervised(tmp_path, "--engine-workers", "2") as sup:
        frontends, workers = sup.children()
        assert len(frontends) == 2 and len(workers) == 2
        sup.proc.kill()
        await sup.proc.wait()
        await wait_gone([*frontends.values(), *workers], 5)


def worker_pid(sup, index: int) -> int | None:
    """The supervisor's engine worker ``index`` (it listens on ``worker-INDEX.sock``)."""
    for pid in sup.children()[1]:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"worker-{index}.sock".encode() in argv:
            return pid
    return None


async def test_a_worker_killed_past_its_budget_is_restarted_and_the_server_serves_on(tmp_path):
    # Issue 42: a worker that died more than --max-restarts times within 60 s made the
    # supervisor give up and exit 1; now it is restarted at the capped backoff (5 s).
    async with supervised(tmp_path, "--engine-workers", "2", "--max-restarts", "1") as sup:
        socket_file = sup.directory() / "worker-0.sock"
        killed: list[int] = []
        alive = ("trio_llm:workers_alive", frozenset({("model_name", "sim")}))

        async def workers_alive() -> list[float]:
            return [(await local_metrics(sup.directory(), i))[alive] for i in (0, 1)]

        async with httpx.AsyncClient(base_url=sup.url, timeout=30,
                                     limits=new_connections()) as http:
            for _ in range(3):  # one more death than the budget allows, and one at the cap
                with trio.fail_after(120):
                    while (pid := worker_pid(sup, 0)) in (None, *killed) \
                            or not socket_file.exists():
                        assert sup.proc.returncode is None, sup.text()
                        await trio.sleep(0.05)
                killed.append(pid)
                os.kill(pid, signal.SIGKILL)
                for _ in range(4):  # served on (by the other worker, or moved there)
                    r = await http.post("/v1/completions",
                                        json={"prompt": "p", "max_tokens": 2})
                    assert r.status_code == 200, r.text
            # left alone, it comes back and both frontends reconnect to it
            with trio.fail_after(120):
                while await workers_alive() != [2, 2]:
                    assert sup.proc.returncode is None, sup.text()
                    await trio.sleep(0.1)
            r = await http.post("/v1/completions", json={"prompt": "p", "max_tokens": 2})
            assert r.status_code == 200, r.text
        assert sup.proc.returncode is None
        assert worker_pid(sup, 0) not in (None, *killed)
        assert sup.text().count("engine worker 0 died more than 1 times within 60 s: "
                                "restarting it every 5 s until it stays up for 60 s") == 1


async def test_a_worker_that_cannot_start_ends_the_supervisor_with_one_line(tmp_path):
    # (no vLLM in this environment: the worker fails at once)
    proc = await trio.run_process(
        [sys.executable, "-m", "server", "--api-servers", "2", "--port", "0",
         "--engine", "vllm", "--model-path", str(tmp_path)],
        capture_stdout=True, capture_stderr=True, check=False,
    )
    assert proc.returncode == 1
    last = proc.stderr.decode().strip().splitlines()[-1]
    assert last == "trio-llm-server: engine worker 0 could not start (exit status 2)", last


# -- without processes -----------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    # (--api-servers 0: argparse's own refusal, tests/test_bad_configuration.py)
    (["--api-servers", "2", "--listen-fd", "3"], "--listen-fd is not an option of --api-servers"),
    (["--listen-fd", "3", "--port", "9000"], "--port: not with --listen-fd"),
    (["--api-servers", "2", "--health-listen-fd", "3"],
     "--health-listen-fd is not an option of --api-servers"),
    (["--health-listen-fd", "3", "--health-port", "9001"], "--health-port: not with --health-l"),
    (["--api-servers", "2", "--port", "9000", "--health-port", "9000"],
     "--health-port must differ from --port"),
    (["--frontend-dir", "/d"], "--frontend-dir and --frontend-index go together"),
])
def test_option_refusals_are_one_line(argv, message):
    with pytest.raises(SystemExit, match=message) as info:
        config_from_args(build_parser().parse_args(argv))
    assert "\n" not in str(info.value.code)


def test_the_command_line_splits_into_the_workers_and_the_frontends():
    parser = build_parser()
    args = parser.parse_args([
        "--api-servers", "3", "--port", "0", "--engine-workers", "2", "--sim-itl-ms", "3",
        "--max-batch", "64", "--shutdown-timeout", "4", "--api-key", "k", "--sim-faults",
        "--engine", "sim", "--model", "m", "--max-restarts", "2", "--health-port", "8001",
    ])
    p = plan(parser, args, python="py")
    assert p.worker_argv("/d/w.sock") == [
        "py", "-m", "server.workers", "--engine", "sim", "--served-model-name", "m",
        "--max-batch", "64",
        "--sim-itl-ms", "3.0", "--sim-faults", "--listen", "unix:/d/w.sock"]
    front = p.frontend_argv(1, 5, "/d", ["unix:/d/w0", "unix:/d/w1"], health_fd=6)
    assert front[:3] == ["py", "-m", "server"]
    config = config_from_args(parser.parse_args(front[3:]))  # a frontend accepts its argv
    assert config.listen_fd == 5 and config.frontend_index == 1
    assert config.health_listen_fd == 6 and config.health_port is None  # (the supervisor's)
    assert config.shutdown_timeout == 4 and config.api_keys == ()  # (the key: not in argv)
    assert config.limits.allow_faults and config.engine.model == "m"
    assert [str(a) for a in config.engine.worker_addresses] == ["unix:/d/w0", "unix:/d/w1"]


def test_metrics_merge_sums_counters_and_histograms_and_labels_gauges():
    def text(requests: int, in_flight: int, le1: int) -> str:
        return (
            "# TYPE r_total counter\n"  # (as prometheus-client writes them)
            f'r_total{{m="a"}} {requests}\n'
            "# TYPE r_created gauge\n"
            f'r_created{{m="a"}} 1.7e9\n'
            "# TYPE g gauge\n"
            f"g {in_flight}\n"
            "# TYPE h histogram\n"
            f'h_bucket{{le="1.0"}} {le1}\nh_bucket{{le="+Inf"}} 5\nh_count 5\nh_sum 2.5\n'
        )
    families = {f.name: f for f in merge_expositions({"0": text(3, 1, 2), "1": text(4, 2, 3)})}
    assert [(s.name, s.labels, s.value) for s in families["r"].samples] == [
        ("r_total", {"m": "a"}, 7.0)]
    assert [s.labels["frontend"] for s in families["r_created"].samples] == ["0", "1"]
    assert [(s.labels, s.value) for s in families["g"].samples] == [
        ({"frontend": "0"}, 1.0), ({"frontend": "1"}, 2.0)]
    assert [(s.name, s.labels.get("le"), s.value) for s in families["h"].samples] == [
        ("h_bucket", "1.0", 5.0), ("h_bucket", "+Inf", 10.0), ("h_count", None, 10.0),
        ("h_sum", None, 5.0)]


def test_restarts_back_off_cap_past_the_budget_and_start_over():
    r = Restarts(3, window=60.0)
    assert [r.died(t, 1.0).delay for t in (0.0, 1.0, 2.0)] == [0.1, 0.2, 0.4]
    fourth = r.died(3.0, 1.0)  # a fourth death within 60 s: over the budget, at the cap
    assert fourth == Restart(5.0, over_budget_now=True) and r.over_budget
    assert r.died(4.0, 1.0) == Restart(5.0)  # (said once an episode)
    assert r.died(5.0, 0.0, charged=False) == Restart(5.0) and r.charged() == 5
    assert r.died(100.0, 99.0) == Restart(0.1) and not r.over_budget  # it lived long
    r = Restarts(1, window=60.0)
    for t in range(5):  # not charged: backs off, spends no budget
        assert r.died(float(t), 0.0, charged=False).delay == min(0.1 * 2 ** t, 5.0)
    assert r.charged() == 0 and not r.over_budget
    assert Restarts(None).died(0.0, 0.0) == Restart(0.1)  # no budget (a remote worker)


async def test_a_killed_supervisors_directory_is_removed_by_the_next_one(tmp_path, monkeypatch):
    import shutil
    import tempfile
    from pathlib import Path

    from server.private_dir import remove_stale_directories

    # Short: the unix sockets' paths must fit in 108 bytes.
    temp = Path(tempfile.mkdtemp(prefix="tl", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(temp))
    unlocked = temp / "trio-llm-older"  # no lock file (an older server's): left alone
    unlocked.mkdir()
    try:
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        async with supervised(tmp_path / "a", "--engine-workers", "1") as first:
            killed = first.directory()
            frontends, workers = first.children()
            first.proc.kill()
            await first.proc.wait()
            await wait_gone([*frontends.values(), *workers], 5)
            assert killed.parent == temp and killed.exists()
            async with supervised(tmp_path / "b", "--engine-workers", "1") as second:
                live = second.directory()
                assert not killed.exists() and live.exists() and unlocked.exists()
                assert "removed 1 private directories of killed supervisors" in second.text()
                # Another supervisor starting now leaves the live one's directory.
                assert remove_stale_directories(str(temp)) == [] and live.exists()
                async with httpx.AsyncClient(base_url=second.url, timeout=10) as http:
                    assert (await http.get("/health")).status_code == 200
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def test_metrics_merge_takes_the_engines_own_counters_once():
    """A shared worker reports its engine's counters alike to every frontend: merged by
    maximum (the freshest), where the frontends' own counters are summed."""
    def text(preemptions: int, steps: int, prefills: int) -> str:
        return (
            "# TYPE trio_llm:num_preemptions_total counter\n"
            f'trio_llm:num_preemptions_total{{worker="0"}} {preemptions}\n'
            "# TYPE trio_llm:iteration_tokens_total histogram\n"
            f'trio_llm:iteration_tokens_total_bucket{{le="+Inf",worker="0"}} {steps}\n'
            f'trio_llm:iteration_tokens_total_count{{worker="0"}} {steps}\n'
            f'trio_llm:iteration_tokens_total_sum{{worker="0"}} {steps * 3}\n'
            "# TYPE trio_llm:request_prefill_time_seconds histogram\n"
            f'trio_llm:request_prefill_time_seconds_count{{worker="0"}} {prefills}\n'
        )
    merged = merge_expositions({"0": text(5, 100, 2), "1": text(6, 104, 3)})
    values = {s.name: s.value for f in merged for s in f.samples}
    assert values["trio_llm:num_preemptions_total"] == 6
    assert values["trio_llm:iteration_tokens_total_count"] == 104
    assert values["trio_llm:iteration_tokens_total_sum"] == 312
    assert values["trio_llm:request_prefill_time_seconds_count"] == 5  # each request once
