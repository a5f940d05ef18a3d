"""Sessions and their transcripts: the SQLite store that is kvd's source of truth.

Knows nothing of MLX: the daemon feeds it text and token ids.
"""

from __future__ import annotations

from common.diskfull import is_disk_full
from common.ids import is_valid_session_id, new_session_id
from common.keep import KEEP, Keep

from .errors import DamagedFedIds, UnknownMessage, UnknownSession
from .rows import Message, Session
from .store import Store

__all__ = [
    "DamagedFedIds",
    "KEEP",
    "Keep",
    "Message",
    "Session",
    "Store",
    "UnknownMessage",
    "UnknownSession",
    "is_disk_full",
    "is_valid_session_id",
    "new_session_id",
]
