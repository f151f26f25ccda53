"""Engine slots and the bounded FIFO queue in front of them.

A :class:`Slot` owns one decoder (built with :func:`dsi.build_decoder`, so it has its own target
servers, drafter thread and KV caches, sharing the loaded weights with the other slots) and one
worker thread that runs its requests, one at a time. The :class:`Scheduler` hands free slots to
requests in arrival order; at most ``max_queue`` requests wait, a further one is refused with
:class:`QueueFull` (the server answers 429).

Every method of the scheduler runs on the event loop's thread (no locks); only
:meth:`Slot.run` runs on the slot's worker thread. The scheduler knows nothing about HTTP.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """Every slot is busy and ``max_queue`` requests are already waiting."""


class RequestCancelled(Exception):
    """A queued request was withdrawn (client gone, server shutting down) before it got a slot."""


class Slot:
    """One decoder and the thread that runs it."""

    def __init__(self, index: int, factory: Callable[[], Any]) -> None:
        self.index = index
        self._factory = factory
        self.decoder = factory()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"dsi-serve-slot{index}")
        self.served = 0

    def recover(self) -> bool:
        """After a failed request: keep the decoder if it can serve on (a model error, a lost target
        server that was replaced: see ``Decoder.healthy``), else rebuild it. Runs on the slot thread;
        returns whether it rebuilt."""
        healthy = getattr(self.decoder, "healthy", None)
        try:
            if healthy is not None and healthy():
                return False
        except Exception:  # noqa: BLE001 - a decoder that cannot tell is replaced
            log.exception("slot %d: checking the decoder's health", self.index)
        log.warning("slot %d: the decoder cannot serve on; rebuilding it", self.index)
        self.rebuild()
        return True

    def rebuild(self) -> None:
        """Replace a decoder that failed (a worker died) by a fresh one. Runs on the slot thread."""
        try:
            self.decoder.close()
        except Exception:  # noqa: BLE001 - a broken decoder may fail to close; we replace it anyway
            log.exception("slot %d: closing the failed decoder", self.index)
        self.decoder = self._factory()

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.decoder.close()


class Scheduler:
    """``len(slots)`` engine slots, requests served in FIFO order, at most ``max_queue`` waiting."""

    def __init__(self, slots: list[Slot], max_queue: int, on_change: Callable[[int, int], None] | None = None) -> None:
        self.slots = slots
        self.max_queue = max_queue
        self._free: collections.deque[Slot] = collections.deque(slots)
        self._waiting: collections.deque[asyncio.Future] = collections.deque()
        self._on_change = on_change
        self.running = 0

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.queued, self.running)

    def reserve(self, prefer: Slot | None = None) -> asyncio.Future:
        """A future that resolves to a slot (at once if one is free: ``prefer`` if it is, whose cache
        may hold the caller's context); :class:`QueueFull` if full."""
        future = asyncio.get_running_loop().create_future()
        if self._free and not self._waiting:
            if prefer is not None and prefer in self._free:
                self._free.remove(prefer)
                self._grant(future, prefer)
            else:
                self._grant(future, self._free.popleft())
        elif len(self._waiting) >= self.max_queue:
            raise QueueFull(f"all {len(self.slots)} engine slots are busy and {self.queued} requests are waiting")
        else:
            self._waiting.append(future)
        self._changed()
        return future

    def _grant(self, future: asyncio.Future, slot: Slot) -> None:
        self.running += 1
        future.set_result(slot)

    def withdraw(self, future: asyncio.Future, reason: str) -> None:
        """Take a request out of the queue (its future raises :class:`RequestCancelled`).

        A future already granted is left alone: its owner runs (and then releases) the slot.
        """
        if future.done():
            return
        try:
            self._waiting.remove(future)
        except ValueError:
            pass
        future.set_exception(RequestCancelled(reason))
        self._changed()

    def release(self, slot: Slot) -> None:
        """Give ``slot`` to the oldest waiting request, or mark it free."""
        self.running -= 1
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                self._grant(future, slot)
                break
        else:
            self._free.append(slot)
        self._changed()

    def withdraw_all(self, reason: str) -> None:
        for future in list(self._waiting):
            self.withdraw(future, reason)

    def close(self) -> None:
        """Stop every slot's thread (after its current request) and close its decoder."""
        for slot in self.slots:
            slot.close()
