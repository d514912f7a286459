#!/usr/bin/env python3
"""Where does a worker's step loop lose time while a heavy request is prepared? (issue 23)

In process, no server: the transformers engine on the tiny model of tests/tiny_model.py
(the size bench/isolation.py uses) steps ``--rows`` streams back to back on this thread, the
way the worker's loop does, while one heavy preparation runs in the worker's real
preparation stage (:class:`server.workers.prepare.Preparer` and its threads). Each step's
wall time is split, for the loop's thread, with the kernel's per-thread scheduler counters
(``/proc/thread-self/schedstat``) into:

* ``cpu``: on a CPU, running;
* ``runq``: runnable but waiting for a CPU (another thread or process had the core);
* ``blocked``: neither: asleep, in this loop that is waiting for the GIL (the loop does no
  I/O here).

The engine's helper process (server/workers/prep_helper.py) prepares what is heavy, as in
a worker (``--no-process``: all in the worker's threads); ``others_cpu_s`` and
``loop_of_process`` count this process's threads only, not the helper's.

Per phase (``baseline``, then each ``--kinds``: ``tokenize``, a 3.5 MB one-word
``/tokenize``; ``schema``, a 2,000-property json_schema compiled with xgrammar; ``template``,
a chat prompt of 20,000 messages rendered by the Jinja template, pure Python) it prints the
steps' p50 and largest wall time and the sums of the three parts over the phase. Run it
pinned to one core to see what the 1-core figures of docs/changelog.md (2026-12-01) saw::

    taskset -c 1 python bench/step_contention.py                     # as the worker runs
    taskset -c 1 python bench/step_contention.py --prepare-nice 10   # niced preparation
    taskset -c 1 python bench/step_contention.py --no-process        # no helper process
    python bench/step_contention.py --switch-interval 0.001

Output: a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.loadgen_lib import smoke  # noqa: E402

#: As bench/isolation.py's TINY.
TINY = {"hidden_size": 256, "heads": 4, "layers": 2, "vocab_size": 1000,
        "max_position_embeddings": 2048}
KINDS = ("tokenize", "schema", "template")
PROMPT = "once upon a time " * 4
PARAMS = {"max_tokens": 1024, "ignore_eos": True}


def _schedstat() -> tuple[int, int]:
    """This thread's nanoseconds on a CPU and waiting on a run queue."""
    with open("/proc/thread-self/schedstat") as f:
        run, wait, _ = f.read().split()
    return int(run), int(wait)


def heavy(kind: str, preparer, rid: int) -> None:
    """Start one heavy preparation of ``kind`` in ``preparer``."""
    if kind == "tokenize":
        preparer.tokenize(rid, {"op": "tokenize", "prompt": "x" * 3_500_000})
    elif kind == "schema":
        props = {f"f{i}": {"type": "string"} for i in range(2000 + rid % 100)}  # uncached
        schema = {"type": "object", "properties": props, "required": list(props),
                  "additionalProperties": False}
        preparer.submit(rid, {"messages": [{"role": "user", "content": "Fill in."}]},
                        {"max_tokens": 1, "response_format": {"type": "json_schema",
                                                               "schema": schema}})
    elif kind == "template":
        messages = [{"role": "user", "content": f"m{i}"} for i in range(20_000)]
        preparer.tokenize(rid, {"op": "tokenize", "prompt": {"messages": messages}})
    else:
        raise ValueError(kind)


def phase(engine, preparer, kind: str | None, seconds: float, rid: int) -> dict:
    """Step for ``seconds`` (baseline) or until the heavy preparation is done."""
    steps = []
    done = False
    if kind is not None:
        heavy(kind, preparer, rid)
    t0 = time.monotonic()
    cpu0, wait0 = _schedstat()
    proc0 = time.process_time()
    while True:
        a = time.monotonic()
        ca, wa = _schedstat()
        out = engine.step(a)
        b = time.monotonic()
        cb, wb = _schedstat()
        steps.append((b - a, (cb - ca) / 1e9, (wb - wa) / 1e9))
        for row in out:  # keep the batch full: a finished stream is replaced
            if row.finish is not None and row.rid < 10_000:
                engine.add(row.rid, PROMPT, PARAMS)
        accepts: list = []
        outputs: list = []
        if kind is not None and (preparer.collect(accepts, outputs) or accepts or outputs):
            done = True
            engine.abort(rid)
        if (kind is None and b - t0 >= seconds) or done or b - t0 > 600:
            break
    wall = time.monotonic() - t0
    cpu1, wait1 = _schedstat()
    others = time.process_time() - proc0 - (cpu1 - cpu0) / 1e9
    walls = sorted(s[0] for s in steps)
    cpu = (cpu1 - cpu0) / 1e9
    runq = (wait1 - wait0) / 1e9
    worst = max(steps)
    return {"phase": kind or "baseline", "seconds": round(wall, 2), "steps": len(steps),
            "step_p50_ms": round(statistics.median(walls) * 1e3, 1),
            "step_max_ms": round(walls[-1] * 1e3, 1),
            "worst_cpu_ms": round(worst[1] * 1e3, 1), "worst_runq_ms": round(worst[2] * 1e3, 1),
            "worst_blocked_ms": round((worst[0] - worst[1] - worst[2]) * 1e3, 1),
            "others_cpu_s": round(others, 2),
            "loop_of_process": round(cpu / max(1e-9, cpu + others), 3),
            "cpu_share": round(cpu / wall, 3), "runq_share": round(runq / wall, 3),
            "blocked_share": round(max(0.0, wall - cpu - runq) / wall, 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64, help="streams in the batch")
    p.add_argument("--baseline", type=float, default=3.0, help="s of the baseline phase")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated: {KINDS}")
    p.add_argument("--prepare-nice", type=int, default=None,
                   help="the preparation threads' nice value (default: the worker's)")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval for this process (default: Python's 5 ms)")
    p.add_argument("--no-process", action="store_true",
                   help="prepare everything in the worker's threads (no helper process)")
    args = smoke.parse_args(p, argv, rows=2, baseline=0.3, kinds="schema")
    import torch

    from server.workers import prepare
    from server.engines.transformers.engine import TransformersEngine
    from tests.tiny_model import build_tiny_model

    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    tmp = tempfile.TemporaryDirectory(prefix="contention-")  # the helper loads from it
    path = build_tiny_model(Path(tmp.name) / "tiny", **TINY)
    engine = TransformersEngine(model_path=str(path), max_batch=args.rows + 8,
                                prepare_process=not args.no_process)
    kwargs = {} if args.prepare_nice is None else {"nice": args.prepare_nice}
    preparer = prepare.Preparer(engine, **kwargs)
    if engine._helper is not None:  # its start is not part of any phase
        engine._helper.wait_started()
    for rid in range(args.rows):
        engine.add(rid, PROMPT, PARAMS)
    for _ in range(5):  # prefill and warm up
        engine.step(time.monotonic())
    rows = [phase(engine, preparer, None, args.baseline, 0)]
    for i, kind in enumerate(k for k in args.kinds.split(",") if k):
        rows.append(phase(engine, preparer, kind, args.baseline, 10_000 + i))
    preparer.close()
    tmp.cleanup()
    print(f"helper process {'off' if args.no_process else 'on'}, "
          f"torch threads {torch.get_num_threads()}, switch interval "
          f"{sys.getswitchinterval() * 1e3:g} ms, preparation nice "
          f"{args.prepare_nice if args.prepare_nice is not None else 'default'}")
    head = ("phase", "seconds", "steps", "step_p50_ms", "step_max_ms", "worst_cpu_ms",
            "worst_runq_ms", "worst_blocked_ms", "others_cpu_s", "loop_of_process",
            "cpu_share", "runq_share", "blocked_share")
    print(" ".join(f"{h[:13]:>13}" for h in head))
    for r in rows:
        print(" ".join(f"{r[h]!s:>13}" for h in head))
    print(json.dumps({"switch_interval": sys.getswitchinterval(),
                      "nice": args.prepare_nice, "phases": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
