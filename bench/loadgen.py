#!/usr/bin/env python3
"""OpenAI-compatible streaming load generator for trio-llm-server (loopback only).

A closed-loop benchmark: ``--concurrency`` clients each send streaming requests back to back
(``POST /v1/completions`` or ``/v1/chat/completions`` with ``stream: true``) until
``--requests`` requests were sent in all or ``--duration`` seconds passed, and measure what a
client sees: time to first token, the gaps between content events, delivered tokens per second,
errors and streams that ended without ``data: [DONE]``. Given the server's process ids it also
reads the CPU time (utime + stime, ``/proc/PID/stat``) of the frontend and of each worker
at the start and the end of the measured window and reports CPU microseconds per delivered
token.

The clients start one after the other over ``--ramp-up`` seconds (default: the nominal length
of one request, ``max_tokens * itl_ms / 1000``): requests of equal length started together
would stay in lockstep forever, arriving in bursts of ``concurrency``. The run is continuous:
requests started in the first ``--warmup`` seconds (default: the ramp-up with ``--duration``,
0 with ``--requests``) are not counted, the ones started after them are, with no pause
between the two; the measured window runs from the end of the warmup until the last measured
request ended.

Examples::

    # against a running server: 30 s measured in the steady state (the default warmup is
    # the ramp-up, itself one request's nominal length: 256 * 8 ms)
    python bench/loadgen.py --url http://127.0.0.1:8000 --concurrency 64 --duration 30 \\
        --prompt-tokens 128 --max-tokens 256 --server-pids-from-port

    # one command: start the server on a free port, load it, stop it
    python bench/loadgen.py --spawn-server "--engine-workers 1 --sim-itl-ms 8" \\
        --concurrency 128 --requests 512 --prompt-tokens 128 --max-tokens 256

    # one wave (--burst): 128 clients send one request each at the same instant; the table
    # compares the wave's wall time with the ideal (max_tokens * itl_ms)
    python bench/loadgen.py --spawn-server "--engine-workers 1" --burst \\
        --concurrency 128 --prompt-tokens 128 --max-tokens 256

Output: a progress line on stderr while it runs, then a summary table and, as the last line
of stdout, one JSON object (see ``summarize``). Exit status: 0 when every request succeeded,
1 when some failed or ended without ``[DONE]``, 2 on a usage or setup error.

The code is in the package ``bench/loadgen_lib`` (its docstring maps the modules); the
metrics are defined in ``loadgen_lib/report.py``.
"""

import sys
from pathlib import Path

# the package sits next to this script (also when run as ``python -m bench.loadgen``)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from loadgen_lib.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
