"""The waiting and swapped queues: first come first served, or kept sorted by a policy's key.

A policy with a static ordering key (priority, shortest job with aging) gets its queue kept in
that order as requests join, instead of re-sorting thousands of waiting requests every step.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterator

from kvsim.policies.request import Request

QueueKey = Callable[[Request], tuple]


class RequestQueue:
    def __init__(self, key: QueueKey | None = None) -> None:
        self._key = key
        self._items: deque[Request] | list[Request] = deque() if key is None else []
        self._keys: list[tuple] = []

    def add(self, request: Request) -> None:
        """A new arrival: at the back, or at its key's place."""
        if self._key is None:
            self._items.append(request)
        else:
            self._insort(request)

    def add_front(self, request: Request) -> None:
        """A preempted request: first in line (FCFS, as vLLM), or at its key's place."""
        if self._key is None:
            self._items.appendleft(request)
        else:
            self._insort(request)

    def _insort(self, request: Request) -> None:
        key = self._key(request)
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._items.insert(i, request)

    def remove(self, request: Request) -> None:
        i = next(i for i, r in enumerate(self._items) if r is request)
        del self._items[i]
        if self._key is not None:
            del self._keys[i]

    def remove_all(self, requests: list[Request]) -> None:
        """Remove ``requests``; fast when they are the first ones in line, as admissions are."""
        if all(a is b for a, b in zip(requests, self._items)):
            if self._key is None:
                for _ in requests:
                    self._items.popleft()
            else:
                del self._items[: len(requests)]
                del self._keys[: len(requests)]
            return
        for request in requests:
            self.remove(request)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)
