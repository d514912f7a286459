"""Keep N cores busy for S seconds, then stop: a ``stress``-like load for flakiness runs.

    python bench/cpu_load.py --cores 2 --seconds 600 &
    python -m pytest -q tests/test_sink.py        # the suite, on busy cores

Each core is one process spinning in a tight loop; every process stops by itself at the
deadline (and when its parent goes away), so a forgotten load never outlives its run by more
than ``--seconds``. Ctrl-C stops them all at once. Prints what it did when it ends.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time

from loadgen_lib import smoke

MAX_SECONDS = 3600.0


def burn(deadline: float, parent: int) -> None:
    """Spin until ``deadline`` (monotonic), or until the parent is gone."""
    n = 0
    while True:
        for _ in range(100_000):
            n += 1
        if time.monotonic() >= deadline or os.getppid() != parent:
            return


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                        help="processes spinning at once (default: every core)")
    parser.add_argument("--seconds", type=float, default=60.0,
                        help=f"how long (at most {MAX_SECONDS:.0f})")
    args = smoke.parse_args(parser, argv, cores=2, seconds=0.5)
    if not 1 <= args.cores <= 256:
        parser.error("--cores must be 1 to 256")
    if not 0 < args.seconds <= MAX_SECONDS:
        parser.error(f"--seconds must be over 0 and at most {MAX_SECONDS:.0f}")
    start = time.monotonic()
    deadline = start + args.seconds
    procs = [
        multiprocessing.Process(target=burn, args=(deadline, os.getpid()), daemon=True)
        for _ in range(args.cores)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()) + 5)
    except KeyboardInterrupt:
        pass
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join()
    print(f"cpu_load: {args.cores} core(s) busy for {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
    main()
