"""Durations and sizes on the command line: ``30d``, ``12h``, ``90`` (seconds); ``4G``,
``512M``, ``1000`` (bytes). Plain argparse types, no trio.

Why: a retention of 30 days is easier read and written as ``30d`` than as ``2592000``, a
budget as ``4G`` than ``4294967296``. Sizes are binary (``K`` = 1024), as ``ulimit``'s and
Kubernetes' ``Gi``: ``4G``, ``4GB``, ``4Gi`` and ``4GiB`` all mean 4 x 1024^3.
"""

from __future__ import annotations

import argparse
import re

__all__ = ["duration", "size"]

_DURATION = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_SIZE = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_NUMBER = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*")


def _read(text: str, units: dict[str, int], what: str, example: str) -> int:
    match = _NUMBER.fullmatch(text.lower())
    unit = match.group(2) if match else ""
    if units is _SIZE and unit[:1] in ("k", "m", "g", "t") and unit[1:] in ("b", "ib"):
        unit = unit[0]
    if match is None or unit not in units:
        raise argparse.ArgumentTypeError(f"expected {what} (e.g. {example}), got {text!r}")
    return int(float(match.group(1)) * units[unit])


def duration(text: str) -> int:
    """Whole seconds of ``90``, ``90s``, ``15m``, ``12h``, ``30d``, ``2w`` (0 allowed)."""
    return _read(text, _DURATION, "seconds or a duration with s, m, h, d or w", "30d")


def size(text: str) -> int:
    """Bytes of ``1000``, ``64K``, ``512M``, ``4G``, ``1T`` (binary; ``GB``/``GiB`` too)."""
    return _read(text, _SIZE, "bytes or a size with K, M, G or T", "4G")
