"""Output and argument types the client tests ask for, as clients write them: nested
(pydantic emits ``$defs`` and ``$ref: "#/$defs/Guest"``), bounded so that the tiny model's
forced outputs stay short (tests/test_clients.py, tests/clients)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, Field


class Guest(BaseModel):
    name: Literal["Ann", "Bob"]
    vip: bool


class Booking(BaseModel):
    nights: int = Field(ge=1, le=9)
    lead: Guest
    guests: list[Guest] = Field(max_length=2)
    extra: Optional[Guest]  # noqa: UP045 (as clients write it)
