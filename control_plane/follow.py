"""The control plane's feed of applied changes, and the `Follow` stream that gives each router its own
view of the fleet (kvroute/fleet/changes.py says what a change is).

    feed = FollowFeed(state, origin=replica_id)   # becomes the state's listener: every change is numbered
    async for message in feed.follow(request):    # what ControlPlane.Follow streams (serialized FollowUpdates)
        ...

Every change the state applies (an agent's registration, batch, heartbeat or departure; a router
session's open, reservation, prefill done, release, close) is serialized once, numbered (`seq`, +1 per
change) and kept in a window of the latest `window_changes` (and at most `window_bytes`). A follower
that names a position in this feed (`FollowRequest.resume_after`) still inside the window gets the
changes after it; any other gets a snapshot first (`kvroute.fleet.changes.snapshot_changes`, built at
one position with no await in between, so it is consistent), then the changes after that position.
Each message carries the changes since the previous one, up to `max_update_bytes`, filtered by the
follower's models; its `position` is the feed position it brings the follower to (filtered changes
included). An idle stream gets an empty message every `keepalive_s`, so that a follower can tell a
quiet fleet from a control plane it no longer hears. A follower whose stream falls behind the window (it reads slower than the fleet changes)
is sent a fresh snapshot on the same stream: the feed's memory is the window, whatever the followers do.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass

from kvroute.fleet.changes import ChangeEncoder, snapshot_changes
from kvroute.fleet.state import FleetState
from kvroute.v1 import kvroute_pb2 as pb

log = logging.getLogger("kvroute.control_plane.follow")

_CHANGES_TAG = b"\x22"  # FollowUpdate.changes: field 4, length-delimited


def _framed(change: pb.FleetChange) -> bytes:
    """The change as a FollowUpdate.changes field (tag, length, message), so that a message of many
    changes is a join of bytes serialized once, whoever follows."""
    data = change.SerializeToString()
    n, head = len(data), bytearray(_CHANGES_TAG)
    while n > 0x7F:
        head.append(n & 0x7F | 0x80)
        n >>= 7
    head.append(n)
    return bytes(head) + data


@dataclass(slots=True)
class FeedCounters:
    snapshots: int = 0  # snapshots sent (a new follower, a position not in the window, fallen behind)
    resumed: int = 0  # followers resumed from their position without a snapshot
    fell_behind: int = 0  # followers whose stream fell behind the window (sent a snapshot again)


class FollowFeed:
    def __init__(
        self,
        state: FleetState,
        origin: str,
        window_changes: int = 200_000,
        window_bytes: int = 256 * 1024 * 1024,
        max_update_bytes: int = 4 * 1024 * 1024,
        keepalive_s: float = 0.5,
    ) -> None:
        self.state = state
        self.origin = origin
        self.feed_id = f"{origin}/{uuid.uuid4().hex[:12]}"
        self.window_changes, self.window_bytes, self.max_update_bytes = window_changes, window_bytes, max_update_bytes
        self.keepalive_s = keepalive_s  # an idle stream still gets a message this often: followers tell fresh from cut off
        self.seq = 0
        self.counters = FeedCounters()
        self.followers = 0
        # The window: the change numbered s is at s % window_changes while s >= self._oldest.
        # (model, router id of a router session's change, framed change)
        self._ring: list[tuple[str, str, bytes] | None] = [None] * window_changes
        self._oldest = 1
        self._ring_bytes = 0
        self._changed: asyncio.Event | None = None
        encoder = ChangeEncoder(state, origin, self._append)
        state.applier.listener = encoder
        state.inflight.listener = encoder

    @property
    def oldest_held(self) -> int:
        """The first seq the window holds (seq + 1 when it holds nothing)."""
        return self._oldest

    def window_size(self) -> tuple[int, int]:
        """(changes, bytes) the window holds."""
        return self.seq + 1 - self._oldest, self._ring_bytes

    def _drop_oldest(self) -> None:
        slot = self._oldest % self.window_changes
        entry = self._ring[slot]
        if entry is not None:
            self._ring_bytes -= len(entry[2])
            self._ring[slot] = None
        self._oldest += 1

    def _append(self, change: pb.FleetChange, model: str) -> None:
        seq = self.seq = self.seq + 1
        if seq - self._oldest >= self.window_changes:
            self._drop_oldest()
        framed = _framed(change)
        router_id = change.router.router_id if change.HasField("router") else ""
        self._ring[seq % self.window_changes] = (model, router_id, framed)
        self._ring_bytes += len(framed)
        while self._ring_bytes > self.window_bytes and self._oldest < seq:
            self._drop_oldest()
        if self._changed is not None:
            self._changed.set()  # wakes every follower waiting now; clear() does not take that back
            self._changed.clear()

    async def _wait_after(self, position: int) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        while self.seq <= position:
            await self._changed.wait()

    def _header(self, position: int, begin: bool = False, end: bool = False) -> bytes:
        update = pb.FollowUpdate(snapshot_begin=begin, snapshot_end=end, sent_unix_us=time.time_ns() // 1000)
        update.position.feed_id, update.position.seq = self.feed_id, position
        return update.SerializeToString()

    def _snapshot(self, models: Collection[str], leave_out: str) -> list[bytes]:
        """A snapshot at the current position, as serialized FollowUpdates (without router `leave_out`'s
        sessions when it is not "")."""
        self.counters.snapshots += 1
        position = self.seq
        changes = [
            _framed(c)
            for c in snapshot_changes(self.state, self.origin, models)
            if not leave_out or c.router.router_id != leave_out
        ]
        messages: list[list[bytes]] = [[]]
        size = 0
        for framed in changes:
            if size + len(framed) > self.max_update_bytes and messages[-1]:
                messages.append([])
                size = 0
            messages[-1].append(framed)
            size += len(framed)
        last = len(messages) - 1
        return [self._header(position, begin=i == 0, end=i == last) + b"".join(part) for i, part in enumerate(messages)]

    async def follow(self, request: pb.FollowRequest) -> AsyncIterator[bytes]:
        """The serialized FollowUpdates for one follower, until it goes away."""
        models = frozenset(request.models)
        leave_out = request.router_id if request.leave_out_own else ""
        resume = request.resume_after
        self.followers += 1
        try:
            if resume.feed_id == self.feed_id and self.oldest_held - 1 <= resume.seq <= self.seq:
                position = resume.seq
                self.counters.resumed += 1
            else:
                position = self.seq
                for message in self._snapshot(models, leave_out):
                    yield message
            while True:
                try:
                    async with asyncio.timeout(self.keepalive_s):
                        await self._wait_after(position)
                except TimeoutError:
                    yield self._header(position)
                    continue
                if position + 1 < self.oldest_held:  # the window moved past it while this stream was slow
                    self.counters.fell_behind += 1
                    log.warning(
                        "router %s fell %d changes behind the follow window: sending a snapshot",
                        request.router_id or "?",
                        self.seq - position,
                    )
                    position = self.seq
                    for message in self._snapshot(models, leave_out):
                        yield message
                    continue
                parts, size, last = [], 0, position
                ring, capacity = self._ring, self.window_changes
                for seq in range(position + 1, self.seq + 1):
                    model, router_id, framed = ring[seq % capacity]
                    if size + len(framed) > self.max_update_bytes and parts:
                        break
                    last = seq
                    if (not models or not model or model in models) and (not leave_out or router_id != leave_out):
                        parts.append(framed)
                        size += len(framed)
                position = last
                yield self._header(position) + b"".join(parts)
        finally:
            self.followers -= 1
