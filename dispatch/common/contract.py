"""Facts every stage shares, written once: the launch modes and the M set a table serves (DESIGN §4, §7)."""

from __future__ import annotations

from typing import Literal

Mode = Literal["graph", "eager"]
MODES: tuple[Mode, ...] = ("graph", "eager")  # the order is the policy feature "mode"'s value
SERVED_MS: tuple[int, ...] = (*range(1, 17), 31)  # decode (1), speculative verification (2..16, 31)
