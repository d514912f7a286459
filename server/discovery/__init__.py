"""Remote workers found by DNS: names that resolve to many workers, re-resolved on a period.

:mod:`.names` parses ``dns:NAME:PORT`` and ``srv:NAME``; :mod:`.dns` asks a DNS server over
Trio's UDP (TCP when the answer is truncated); :mod:`.watch` keeps one name's addresses
current; :mod:`.pool` adds and drains the engine's workers as they change. docs/scaling.md,
"Workers found by DNS", says how to use it.
"""
