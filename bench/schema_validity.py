#!/usr/bin/env python3
"""Structured output over real-world JSON schemas: is every complete answer valid?

What it measures
----------------
A real server (``python -m server --engine transformers``) on the tiny random test model
(``tests/tiny_model.py``: random weights make the answers diverse, which is what exercises
a grammar), and a corpus of JSON schemas built offline from what is installed
(``bench/schema_corpus.py``: pydantic models of the openai SDK, MCP, FastAPI and vLLM,
dataclasses, Kubernetes' schema files, the metaschemas, and a handwritten set of the
constructs clients send). Each schema is sent ``--seeds`` times (temperature 1, a seed
each) in each mode:

* ``response_format``: chat with ``{"type": "json_schema", "json_schema": {"schema": ...,
  "strict": true}}``; the answer is the message's content;
* ``tool``: chat with the schema as a ``strict`` tool's ``parameters`` and that tool named
  in ``tool_choice`` (object schemas only); the answer is the call's ``arguments``.

Reported, per mode: the share of requests accepted (else the 400's reason, counted by
construct), the share of accepted answers finishing with ``stop`` (``tool_calls`` for a
forced call) or ``length``, and of those finishing with ``stop``, the share that parse
strictly (``json.loads``: no raw control characters) and validate against the schema
(the ``jsonschema`` package, with the format checks it has installed). Every failure
(parse, validation, or a status other than 200 and 400) is printed with its schema id,
mode, seed and output; the exit status is 1 if there is any.

Output: failures as they come, a table per mode, then one JSON line of figures.

Example::

    python bench/schema_validity.py              # ~10 minutes on 2 cores
    python bench/schema_validity.py --quick      # ~1 minute
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.loadgen_lib import smoke  # noqa: E402
from bench.loadgen_lib.spawn import SpawnedServer  # noqa: E402
from bench.schema_corpus import SOURCES, build_corpus  # noqa: E402

MODES = ("response_format", "tool")
PROMPT = "Fill in the form as JSON."

#: A 400's reason -> the construct it names (the first that matches; else the message).
_REASONS = [
    (r"refers to another document", "$ref to another document"),
    (r"names an anchor", "$ref to an anchor"),
    (r"points into a list", "$ref into a list"),
    (r"points to nothing", "$ref to nothing"),
    (r"'\$(dynamicRef|recursiveRef)'", "$dynamicRef/$recursiveRef"),
    (r"beyond 64 bits", "integer beyond 64 bits"),
    (r"too large to compile", "schema too large"),
    (r"did not compile within", "compile timeout"),
    (r"'([^']+)' at \S+ is not enforced by the grammar", None),  # server.engines.transformers.schema_check
    (r"context|prompt .*tokens", "prompt over the context"),
]


def reason_of(message: str) -> str:
    """The construct a 400's message names (see :data:`_REASONS`)."""
    for pattern, name in _REASONS:
        found = re.search(pattern, message)
        if found:
            return name or found.group(1)
    text = re.sub(r"\[[\d:]+\] /\S+: ", "", message)  # xgrammar's "[time] file:line: "
    text = re.sub(r"\d+", "N", text.split("unsupported JSON schema: ")[-1])
    return text.strip()[:80]


def _is_object_schema(schema) -> bool:
    return isinstance(schema, dict) and (schema.get("type") == "object" or "properties" in schema)


def _validator(schema):
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def check(validator, text: str) -> str | None:
    """What is wrong with an answer (None: it parses strictly and validates)."""
    try:
        value = json.loads(text)  # strict: no raw control characters in strings
    except ValueError as exc:
        return f"does not parse: {exc}"
    try:
        errors = list(validator.iter_errors(value))
    except (OverflowError, ValueError, RecursionError) as exc:  # 1e999 is inf, for one
        return f"cannot be validated: {type(exc).__name__}: {exc}"
    if errors:
        e = errors[0]
        return f"invalid at {'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message[:300]}"
    return None


def request_body(model: str, schema: dict, mode: str, seed: int, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens, "temperature": 1.0, "seed": seed}
    if mode == "response_format":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "answer", "schema": schema, "strict": True}}
    else:
        body["tools"] = [{"type": "function", "function": {
            "name": "answer", "parameters": schema, "strict": True}}]
        body["tool_choice"] = {"type": "function", "function": {"name": "answer"}}
    return body


async def one(client: httpx.AsyncClient, model: str, job: tuple, max_tokens: int) -> dict:
    source, sid, schema, mode, seed = job
    row = {"source": source, "id": sid, "mode": mode, "seed": seed}
    r = await client.post("/v1/chat/completions",
                          json=request_body(model, schema, mode, seed, max_tokens))
    row["status"] = r.status_code
    if r.status_code != 200:
        try:
            row["error"] = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            row["error"] = r.text[:300]
        return row
    choice = r.json()["choices"][0]
    finish = choice["finish_reason"]
    message = choice["message"]
    row["finish"] = "stop" if finish in ("stop", "tool_calls") else finish
    if mode == "tool":
        calls = message.get("tool_calls") or []
        row["text"] = calls[0]["function"]["arguments"] if calls else (message.get("content") or "")
        if row["finish"] == "stop" and len(calls) != 1:
            row["problem"] = f"finished with {finish!r} but {len(calls)} tool calls"
    else:
        row["text"] = message.get("content") or ""
    return row


async def run_jobs(url: str, model: str, jobs: list, concurrency: int, max_tokens: int,
                   on_row) -> None:
    send, receive = trio.open_memory_channel(len(jobs))
    for job in jobs:
        send.send_nowait(job)
    send.close()

    async def worker(client: httpx.AsyncClient) -> None:
        async for job in receive:
            on_row(job, await one(client, model, job, max_tokens))

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker, client)


def _share(n: int, d: int) -> str:
    return f"{n}/{d} ({100 * n / d:.1f}%)" if d else "0/0"


def summarize(rows: list[dict]) -> dict:
    out = {}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        accepted = [r for r in mine if r["status"] == 200]
        refused = collections.Counter(reason_of(r["error"]) for r in mine if r["status"] == 400)
        other = collections.Counter(r["status"] for r in mine if r["status"] not in (200, 400))
        stop = [r for r in accepted if r["finish"] == "stop"]
        length = [r for r in accepted if r["finish"] == "length"]
        bad = [r for r in stop if r.get("problem")]
        out[mode] = {
            "requests": len(mine), "schemas": len({r["id"] for r in mine}),
            "accepted": len(accepted), "refused": dict(refused.most_common()),
            "other_status": {str(k): v for k, v in other.items()},
            "stop": len(stop), "length": len(length),
            "stop_valid": len(stop) - len(bad), "stop_invalid": len(bad),
            "schemas_with_valid_stop": len({r["id"] for r in stop if not r.get("problem")}),
        }
    return out


def print_table(summary: dict) -> None:
    for mode, s in summary.items():
        print(f"\n== {mode}: {s['requests']} requests, {s['schemas']} schemas")
        print(f"  accepted        {_share(s['accepted'], s['requests'])}")
        for reason, n in s["refused"].items():
            print(f"    400 {n:>5}  {reason}")
        for status, n in s["other_status"].items():
            print(f"    {status} {n:>5}  (a failure)")
        print(f"  finish stop     {_share(s['stop'], s['accepted'])}")
        print(f"  finish length   {_share(s['length'], s['accepted'])}")
        print(f"  stop and valid  {_share(s['stop_valid'], s['stop'])}"
              f"   (schemas with a valid stop answer: {s['schemas_with_valid_stop']})")


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                             capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, text=True, capture_output=True).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="a ~1 minute run: 15 schemas a source, small packages only (no "
                        "dataclasses), 2 seeds")
    p.add_argument("--per-source", type=int, default=90,
                   help="schemas taken from each source (the handwritten ones: all)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-bytes", type=int, default=8192, help="largest schema (compact JSON)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--heartbeat-timeout", type=float, default=None,
                   help="the server's (default: the server's own, 10 s; the worker's pulse "
                        "speaks for it during long steps on a busy machine)")
    p.add_argument("--num-threads", type=int, default=1, help="the worker's torch threads")
    p.add_argument("--json-out", help="write every row (status, finish, output) here")
    p.add_argument("--limit", type=int, default=None,
                   help="send at most this many schemas, evenly spaced over the corpus")
    args = smoke.parse_args(p, argv, quick=True, per_source=2, seeds=1, max_tokens=16,
                            concurrency=2, limit=6)
    if args.quick and not args.smoke:
        args.per_source, args.seeds, args.max_tokens = 15, 2, 160
    modes = [m for m in args.modes.split(",") if m]
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        print("the jsonschema package is not installed: answers are only parsed, not "
              "validated", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    from tests.tiny_model import build_tiny_model

    started = time.perf_counter()
    model_dir = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny",
                                 max_position_embeddings=16384)
    server = SpawnedServer(
        f"--engine transformers --model-path {model_dir} --num-threads {args.num_threads} "
        f"--max-batch {args.concurrency} "
        + (f"--heartbeat-timeout {args.heartbeat_timeout} " if args.heartbeat_timeout else "")
        + "--disable-log-requests --log-level warning",
        "server", None)
    try:
        sources = [s for s in SOURCES if not (args.quick and s == "dataclasses")]
        corpus = build_corpus(per_source=args.per_source, max_bytes=args.max_bytes,
                              sources=sources, quick=args.quick)
        if args.limit is not None:
            corpus = corpus[::max(1, len(corpus) // args.limit)][:args.limit]
        corpus_s = time.perf_counter() - started
        print(f"corpus: {len(corpus)} schemas "
              f"({dict(collections.Counter(s for s, _, _ in corpus))}), built in {corpus_s:.0f} s",
              flush=True)
        trio.run(server.wait_healthy, 300.0)
        jobs = [(source, sid, schema, mode, seed)
                for mode in modes for source, sid, schema in corpus
                if mode != "tool" or _is_object_schema(schema)
                for seed in range(args.seeds)]
        validators = {}
        rows: list[dict] = []
        failures = 0

        def on_row(job, row) -> None:
            nonlocal failures
            schema = job[2]
            if row["status"] == 200 and row["finish"] == "stop" and "problem" not in row:
                key = id(schema)
                if key not in validators:
                    validators[key] = _validator(schema)
                problem = check(validators[key], row["text"])
                if problem:
                    row["problem"] = problem
            if row.get("problem") or row["status"] not in (200, 400):
                failures += 1
                print(f"FAIL {row['source']}:{row['id']} mode={row['mode']} seed={row['seed']} "
                      f"status={row['status']}: {row.get('problem') or row.get('error')}\n"
                      f"  schema: {json.dumps(schema)[:600]}\n"
                      f"  output: {row.get('text', '')!r}", flush=True)
            rows.append(row)

        t0 = time.perf_counter()
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        trio.run(run_jobs, server.url, model, jobs, args.concurrency, args.max_tokens, on_row)
        run_s = time.perf_counter() - t0
    except BaseException:
        print(server.log_tail(), file=sys.stderr)
        raise
    finally:
        server.stop()
    summary = summarize(rows)
    print_table(summary)
    import jsonschema

    checked = sorted(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers)
    print(f"\nformats jsonschema checks here: {', '.join(checked)}")
    print(f"{len(rows)} requests in {run_s:.0f} s (corpus {corpus_s:.0f} s); "
          f"{failures} failures")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, ensure_ascii=False, indent=1))
    print(json.dumps({"bench": "schema_validity", "commit": git_commit(),
                      "settings": {k: getattr(args, k) for k in (
                          "quick", "per_source", "seeds", "max_tokens", "max_bytes",
                          "concurrency")},
                      "corpus": len(corpus), "seconds": round(run_s), "failures": failures,
                      "modes": summary}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
