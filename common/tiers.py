"""The names of the cache tiers, fastest first, and the two names beside them.

The values of a session's "cache", of "usage.restored_from" and of status
"locations" (docs/protocol.md), and the tier names inside cachestore.
"""

from __future__ import annotations

from typing import Final, Literal

RESIDENT: Final = "resident"
WARM: Final = "warm"
DISK: Final = "disk"
TIERS: Final = (RESIDENT, WARM, DISK)
Tier = Literal["resident", "warm", "disk"]
# Only the transcript is left.
NO_CACHE: Final = "none"
# "usage.restored_from" only: the prefix came from another session's cache
# (in memory, or content-addressed blocks on disk); "shared_tokens" says how much.
SHARED: Final = "shared"
