#!/usr/bin/env python3
"""Frontend CPU per streamed event of ``/v1/responses`` against chat completions, in
process (no server).

What it measures
----------------
The bytes of one text delta event: chat's :meth:`ChunkEncoder.delta` (the plain SSE path)
and :meth:`ResponseEvents.feed` of an open message item (``response.output_text.delta``,
from its pre-encoded head and tail), best of ``--repeat`` runs of ``--events`` each, in
microseconds per event; and a whole answer of ``--events`` deltas (``start``, the deltas,
``end``) per event.

Example::

    python bench/responses_events.py --events 100000
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.loadgen_lib import smoke  # noqa: E402
from server.openai.encode import ChunkEncoder  # noqa: E402
from server.openai.responses_events import ResponseEvents, new_response, response_usage  # noqa: E402


def whole(events: int) -> None:
    ev = ResponseEvents(new_response("resp_x", 0, "m", {}), reasoning_parser=None, tools=None)
    ev.start()
    for _ in range(events):
        ev.feed(" word")
    ev.end("length", response_usage(4, events, None))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--events", type=int, default=100_000)
    p.add_argument("--repeat", type=int, default=5)
    args = smoke.parse_args(p, events=100, repeat=1)
    n = args.events
    enc = ChunkEncoder(chat=True, response_id="chatcmpl-x", created=0, model="m")
    ev = ResponseEvents(new_response("resp_x", 0, "m", {}), reasoning_parser=None, tools=None)
    ev.start()
    ev.feed(" first")
    chat = min(timeit.repeat(lambda: enc.delta(0, " word"), number=n, repeat=args.repeat)) / n
    resp = min(timeit.repeat(lambda: ev.feed(" word"), number=n, repeat=args.repeat)) / n
    full = min(timeit.repeat(lambda: whole(n), number=1, repeat=args.repeat)) / n
    print(f"chat delta event:       {chat * 1e6:.2f} us")
    print(f"responses delta event:  {resp * 1e6:.2f} us")
    print(f"responses whole answer: {full * 1e6:.2f} us per event ({n} events)")


if __name__ == "__main__":
    main()
