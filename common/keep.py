"""`KEEP`: a field an update left out, to leave as it is (None would clear it)."""

from __future__ import annotations

import enum


class Keep(enum.Enum):
    KEEP = enum.auto()


KEEP = Keep.KEEP
