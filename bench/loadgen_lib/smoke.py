"""``--smoke``: every bench script's quick run, which CI runs (tests/test_bench_smoke.py) so
that a bench that no longer runs fails CI rather than the next measurement.

A smoke run takes seconds: tiny settings (a few streams, a few tokens, one round) through
the script's real code path, end to end, with its usual output; its figures mean nothing.
What a script cannot run on a CPU-only machine (a GPU, vLLM's own server, a vLLM engine
beyond the one smoke run that loads it) is skipped with a line saying so (:func:`skipped`).
"""

from __future__ import annotations

import argparse
import sys

HELP = ("a quick run with tiny settings (seconds; CI runs it): proves that the script runs; "
        "its figures mean nothing")


def parse_args(parser: argparse.ArgumentParser, argv=None, **settings) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with a ``--smoke`` option added: given it, ``settings``
    (option destinations and values) replace the defaults; options given on the command line
    still win."""
    unknown = set(settings) - {action.dest for action in parser._actions}
    if unknown:  # (set_defaults would take them silently)
        raise ValueError(f"smoke settings for no option: {sorted(unknown)}")
    parser.add_argument("--smoke", action="store_true", help=HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**settings)
        args = parser.parse_args(argv)
        shown = " ".join(f"{key}={value}" for key, value in settings.items())
        print(f"smoke run ({shown or 'the defaults'}): the figures mean nothing",
              file=sys.stderr, flush=True)
    return args


def skipped(what: str) -> None:
    """Say what a smoke run leaves out (stderr)."""
    print(f"smoke run: skipped {what}", file=sys.stderr, flush=True)
