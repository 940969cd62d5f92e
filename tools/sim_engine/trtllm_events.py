"""TensorRT-LLM's pull path for KV-cache events: `POST /kv_cache_events` drains a JSON array
(docs/wire-formats.md#tensorrt-llm-pull-path-json).

The queue stands in for TRT-LLM's KV-cache event manager behind trtllm-serve. Each event is
`{"event_id", "data", "window_size"}` (+ `"attention_dp_rank"` when the engine has one, +
`"hash_algo": "v2_sha256"` with hex hashes), `data` one of:
- `created` (`num_blocks_per_cache_level`: [GPU blocks, host blocks]), queued at start-up;
- `stored` (`parent_hash`, `blocks`: `stored_block` with `block_hash`, `tokens` of
  `unique_token` {token_id, token_extra_id 0}, `cache_level` 0, `priority` 35 (TRT-LLM's default
  retention priority), and `lora_id` / `cache_salt` when the request has them);
- `removed` (`block_hashes`);
- `updated` (`block_hash`, `cache_level` event_diff old -> new, `priority` null): a block offloaded
  to the secondary (host) level or onboarded back, which TRT-LLM reports as a level change, not
  as remove + store.
A reset has no event of its own on this path: it is one `removed` of every block.
`window_size` is the attention window: the whole context for a full-attention model.

The buffer keeps at most `max_size` events (KvCacheConfig.event_buffer_max_size); beyond it the
oldest go, which a poller sees as a gap in `event_id`. Fault hooks mirror the ZMQ publisher's:
drop the events of the next N steps (their ids are used up) or restart (ids from 0, buffer
emptied, a new `created`).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from kvroute.tools.sim_engine.kv_publisher import FaultState
from kvroute.tools.sim_engine.prefix_cache import GPU, CacheEvent, ClearedEvent, RemovedEvent, StoredEvent

DEFAULT_PRIORITY = 35
CACHE_LEVELS = {GPU: 0, "CPU": 1}  # primary, secondary


class TrtllmEventQueue:
    def __init__(
        self,
        num_blocks: int,
        secondary_blocks: int,
        window_size: int,
        max_size: int = 10000,
        hex_hashes: bool = False,
        attention_dp_rank: int | None = None,
    ) -> None:
        if max_size <= 0:
            raise ValueError("event_buffer_max_size must be positive")
        self.num_blocks, self.secondary_blocks = num_blocks, secondary_blocks
        self.window_size, self.max_size = window_size, max_size
        self.hex_hashes, self.attention_dp_rank = hex_hashes, attention_dp_rank
        self.events: deque[dict[str, Any]] = deque()
        self.next_event_id = 0
        self.faults = FaultState()
        self._created()

    # the same lifecycle as KvEventPublisher, so the engine drives either
    def start(self) -> None:
        pass

    async def flush(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    def _created(self) -> None:
        self._append({"type": "created", "num_blocks_per_cache_level": [self.num_blocks, self.secondary_blocks]})

    def _append(self, data: dict[str, Any]) -> None:
        event: dict[str, Any] = {"event_id": self.next_event_id, "data": data, "window_size": self.window_size}
        if self.attention_dp_rank is not None:
            event["attention_dp_rank"] = self.attention_dp_rank
        if self.hex_hashes:
            event["hash_algo"] = "v2_sha256"
        self.next_event_id += 1
        self.events.append(event)
        if len(self.events) > self.max_size:
            self.events.popleft()

    def publish(self, events: list[CacheEvent]) -> None:
        """The events of one scheduler step."""
        if not events:
            return
        if self.faults.drop_next_batches:
            self.faults.drop_next_batches -= 1
            self.faults.dropped_by_fault += 1
            self.next_event_id += sum(len(self.to_json(e)) for e in events)  # their ids are used up: a gap
            return
        for event in events:
            for data in self.to_json(event):
                self._append(data)

    def to_json(self, event: CacheEvent) -> list[dict[str, Any]]:
        """The `data` objects of one cache event (none, one, or one `updated` per block)."""
        if isinstance(event, StoredEvent):
            if event.moved_from is not None:
                return [
                    {
                        "type": "updated",
                        "block_hash": h,
                        "cache_level": {
                            "type": "event_diff",
                            "old_value": CACHE_LEVELS[event.moved_from],
                            "new_value": CACHE_LEVELS[event.medium],
                        },
                        "priority": None,
                    }
                    for h in event.block_hashes
                ]
            return [{"type": "stored", "parent_hash": event.parent_block_hash, "blocks": self._blocks(event)}]
        if isinstance(event, RemovedEvent):
            return [] if event.moved_to is not None else [{"type": "removed", "block_hashes": list(event.block_hashes)}]
        if isinstance(event, ClearedEvent):
            return [{"type": "removed", "block_hashes": list(event.block_hashes)}] if event.block_hashes else []
        raise TypeError(f"unknown cache event {event!r}")

    def _blocks(self, event: StoredEvent) -> list[dict[str, Any]]:
        ns, tokens = event.namespace, list(event.token_ids)
        size = len(tokens) // len(event.block_hashes)
        blocks = []
        for i, h in enumerate(event.block_hashes):
            block: dict[str, Any] = {
                "type": "stored_block",
                "block_hash": h,
                "tokens": [
                    {"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens[i * size : (i + 1) * size]
                ],
                "cache_level": CACHE_LEVELS[event.medium],
                "priority": DEFAULT_PRIORITY,
            }
            if ns.lora_id is not None:
                block["lora_id"] = ns.lora_id
            if ns.cache_salt:
                block["cache_salt"] = ns.cache_salt
            blocks.append(block)
        return blocks

    def drain(self) -> list[dict[str, Any]]:
        """Every queued event, oldest first; the queue is empty afterwards (the endpoint is destructive)."""
        out = list(self.events)
        self.events.clear()
        return out

    def inject_faults(self, drop_next_batches: int = 0, restart: bool = False) -> dict[str, int]:
        if restart:
            self.events.clear()
            self.next_event_id = 0
            self.faults.restarts += 1
            self._created()
        self.faults.drop_next_batches += drop_next_batches
        return {
            "next_event_id": self.next_event_id,
            "drop_next_batches": self.faults.drop_next_batches,
            "dropped_by_fault": self.faults.dropped_by_fault,
            "restarts": self.faults.restarts,
        }
