"""The caches of the last values made: a bounded map that drops the least recently used entry first.

The values these caches hold keep alive what their keys name by identity (a layout, a function), so a cache
is bounded rather than weak; a lock makes each lookup and store atomic, while the value itself is made
outside it (two threads may make the same one: the first stored wins where the caller asks).

>>> kept = Recent(2)
>>> kept.put("a", 1), kept.put("b", 2), kept.get("a"), kept.put("c", 3)
(1, 2, 1, 3)
>>> kept.get("b"), len(kept)
(None, 2)
"""

from __future__ import annotations

import collections
import threading

_MISSING = object()


class Recent:
    """The last `size` values stored, by key (`get`, `put`), the least recently used dropped first."""

    def __init__(self, size: int):
        self.size = size
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key, default=None):
        """The value stored under `key` (now the most recently used), or `default`."""
        with self._lock:
            value = self._entries.get(key, _MISSING)
            if value is _MISSING:
                return default
            self._entries.move_to_end(key)
            return value

    def put(self, key, value, *, first: bool = False):
        """Store `value` under `key` and return what is stored there: with `first`, a value stored before
        (by another thread that made it at the same time) stays, and is returned."""
        with self._lock:
            if first:
                value = self._entries.setdefault(key, value)
            else:
                self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
            return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
