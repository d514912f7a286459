"""``--engine-arg KEY=VALUE`` pairs, parsed. Sans-IO; imports nothing of vLLM's (the
frontend checks the pairs' form; the worker checks their names against vLLM's EngineArgs)."""

from __future__ import annotations

import json

__all__ = ["parse_engine_args"]


def parse_engine_args(pairs: list[str] | tuple[str, ...]) -> dict:
    """``["enforce_eager=true", "kv-cache-memory-bytes=1e9"]`` -> vLLM engine arguments.

    A value is read as JSON when it parses (numbers, booleans, null, lists, objects), else it
    is the string itself; dashes in a key become underscores. A key given twice takes its last
    value, as a repeated flag does in vLLM's command line (argparse). Raises ValueError naming
    a pair without ``=``."""
    out: dict = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ValueError(f"--engine-arg needs KEY=VALUE, not {pair!r}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out[key] = value
    return out
