"""The range of each numeric command-line option (the server's, and a listening worker's),
checked as argparse reads it.

Why: ``--max-body-bytes -1`` started a server that answered every request 413 "larger
than -1 bytes", and other negative or zero limits started too. A value outside its option's
range is refused at start, in argparse's one line naming the option (``argument
--max-body-bytes: expected an integer of at least 1, got '-1'``), on the command line and in
a ``--model-config`` file alike (both are read by the same parser). NaN and infinities are
never a value.

:class:`Bounds` is an option's least value (and its greatest, for ports and fractions),
given in its option table's entry (server.option_table.Option.bounds); 0 is allowed where
the option's help gives 0 a meaning ("0: never", "0: no limit"). Options passed through to
vLLM as they are (``--seed``, ``--max-logprobs``, ...) are vLLM's to check.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

__all__ = ["COUNT", "FRACTION", "PORT", "SECONDS", "ZERO_OK", "Bounds", "checked"]


@dataclass(frozen=True)
class Bounds:
    """``low`` (included, or excluded with ``above``) to ``high`` (included, None: none)."""

    low: float
    high: float | None = None
    above: bool = False  # the value must be greater than ``low``

    def check(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if value < self.low or (self.above and value == self.low):
            return False
        return self.high is None or value <= self.high

    def say(self, kind: str) -> str:
        if self.high is not None:
            if self.above:
                return f"{kind} greater than {self.low:g} and at most {self.high:g}"
            return f"{kind} from {self.low:g} to {self.high:g}"
        return f"{kind} {'greater than' if self.above else 'of at least'} {self.low:g}"


PORT = Bounds(0, 65535)
COUNT = Bounds(1)  # a size, a count: 0 would refuse everything
ZERO_OK = Bounds(0)  # 0 has a meaning (never, none, no limit, at once)
SECONDS = Bounds(0, above=True)  # a timeout whose 0 has no meaning
FRACTION = Bounds(0, 1, above=True)


def checked(convert, bounds: Bounds):
    """``convert`` (int or float) refusing, in argparse's words, a value out of ``bounds``."""
    kind = "an integer" if convert is int else "a number"

    def read(text: str):
        try:
            value = convert(text)
        except (TypeError, ValueError):
            value = math.nan
        if not bounds.check(value):
            raise argparse.ArgumentTypeError(f"expected {bounds.say(kind)}, got {text!r}")
        return value

    read.__name__ = getattr(convert, "__name__", "number")
    read.bounds = bounds  # type: ignore[attr-defined]  # (what tests check)
    return read
