"""RedisEventLog: agents' messages go through Redis Streams; every replica applies every shard.

See docs/architecture.md, "Replicas over Redis". In short: a worker id maps to a shard; each
shard's keys share one Cluster hash tag, so the Lua scripts below touch one slot. The replica an
agent is connected to appends (register / batch / heartbeat) with a script that checks the
worker's epoch and sequence; every replica tails every shard with a blocking XREAD and hands each
entry to the `LogApplier`. Expiry is an entry too, appended by whichever replica notices a
silent worker once Redis says its owner key is gone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import xxhash
from redis.exceptions import RedisError

from kvroute.aio import cancel_and_wait
from kvroute.control_plane.replication.event_log import (
    AgentSession,
    LogRefusal,
    check_register,
    in_use_detail,
    register_body,
)
from kvroute.control_plane.replication.redis_url import redis_backoff
from kvroute.fleet.apply import LogApplier
from kvroute.fleet.entries import (
    BATCH_DECODER,
    ENCODER,
    HEARTBEAT_DECODER,
    REGISTER_DECODER,
    SNAPSHOT_DECODER,
    BatchBody,
    BlockOp,
    HeartbeatBody,
    ops_from_events,
    pack_ops,
    tier_or_disk,
    unpack_ops,
)
from kvroute.fleet.registry import WorkerRecord
from kvroute.v1 import kvroute_pb2 as pb

log = logging.getLogger("kvroute.control_plane.redis")

KIND_REGISTER, KIND_BATCH, KIND_HEARTBEAT, KIND_EXPIRE = b"r", b"b", b"h", b"x"
KIND_PB_BATCH = b"p"  # a batch whose body is the agent's EventBatch, serialized again
META = "kvroute:{kvroute:meta}"
NO_ID = b"0-0"

# KEYS: stream, shard entry counter, worker hash, owner key.
# ARGV: worker id, agent instance, owner value ("instance|peer"), owner TTL ms, body.
REGISTER = """
local owner = redis.call('GET', KEYS[4])
if owner then
  local bar = string.find(owner, '|', 1, true)
  if ARGV[2] == '' or string.sub(owner, 1, bar - 1) ~= ARGV[2] then
    return {'in_use', string.sub(owner, bar + 1)}
  end
end
local epoch = redis.call('HINCRBY', KEYS[3], 'epoch', 1)
local seq, resume = 0, 0
if ARGV[2] ~= '' and redis.call('HGET', KEYS[3], 'instance') == ARGV[2] then
  seq = tonumber(redis.call('HGET', KEYS[3], 'seq') or '0')
  resume = 1
end
redis.call('HSET', KEYS[3], 'instance', ARGV[2], 'seq', seq)
redis.call('SET', KEYS[4], ARGV[3], 'PX', ARGV[4])
local n = redis.call('INCR', KEYS[2])
redis.call('XADD', KEYS[1], '*', 't', 'r', 'w', ARGV[1], 'e', epoch, 's', seq, 'n', n, 'r', resume, 'd', ARGV[5])
return {'ok', epoch, seq, resume}
"""

# KEYS as REGISTER. ARGV: worker id, epoch, kind ('b' or 'p' batch, 'h' heartbeat), seq, owner value, TTL ms, body.
APPEND = """
local epoch = redis.call('HGET', KEYS[3], 'epoch')
if epoch ~= ARGV[2] then return {'stale', epoch or '0'} end
local seq = 0
if ARGV[3] ~= 'h' then
  local last = tonumber(redis.call('HGET', KEYS[3], 'seq') or '0')
  seq = tonumber(ARGV[4])
  if seq ~= last + 1 then return {'sequence', last} end
  redis.call('HSET', KEYS[3], 'seq', ARGV[4])
end
redis.call('SET', KEYS[4], ARGV[5], 'PX', ARGV[6])
local n = redis.call('INCR', KEYS[2])
redis.call('XADD', KEYS[1], '*', 't', ARGV[3], 'w', ARGV[1], 'e', ARGV[2], 's', ARGV[4], 'n', n, 'd', ARGV[7])
return {'ok', n}
"""

# KEYS as REGISTER. ARGV: worker id, the epoch the caller saw. Nothing while the owner key lives or
# the epoch moved on; else fence the epoch, forget the instance (no resume) and log the expiry.
EXPIRE = """
if redis.call('EXISTS', KEYS[4]) == 1 then return 0 end
if redis.call('HGET', KEYS[3], 'epoch') ~= ARGV[2] then return 0 end
local epoch = redis.call('HINCRBY', KEYS[3], 'epoch', 1)
redis.call('HSET', KEYS[3], 'instance', '', 'seq', 0)
local n = redis.call('INCR', KEYS[2])
redis.call('XADD', KEYS[1], '*', 't', 'x', 'w', ARGV[1], 'e', epoch, 's', 0, 'n', n, 'd', '')
return 1
"""

# KEYS: worker hash, owner key. ARGV: epoch, owner value. The stream that owned the id ended.
RELEASE = """
if redis.call('HGET', KEYS[1], 'epoch') == ARGV[1] and redis.call('GET', KEYS[2]) == ARGV[2] then
  redis.call('DEL', KEYS[2])
  return 1
end
return 0
"""

# KEYS: snapshot hash, shard's fencing token, stream. ARGV: token, covered id, covered n, then
# worker id / snapshot pairs. Refused for an older token or a snapshot behind the stored one.
WRITE_SNAPSHOT = """
if tonumber(ARGV[1]) < tonumber(redis.call('GET', KEYS[2]) or '0') then return 0 end
if tonumber(ARGV[3]) < tonumber(redis.call('HGET', KEYS[1], '__n') or '0') then return 0 end
redis.call('SET', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], '__id', ARGV[2], '__n', ARGV[3])
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('XTRIM', KEYS[3], 'MINID', ARGV[2])
return 1
"""

# KEYS: lease. ARGV: holder, TTL ms. Renew the lease while we still hold it.
RENEW_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

# KEYS: lease. ARGV: holder. Give the lease up (if still ours) so another replica takes it now.
RELEASE_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def raise_if_cancelled() -> None:
    """A cancellation that lands inside a redis-py read can come out as a Redis TimeoutError (Python
    3.11's asyncio.timeout under redis-py's rescheduled read deadlines); a loop that retries on Redis
    errors calls this first, so a cancelled task still stops."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()


def shard_of(worker_id: str, shards: int) -> int:
    """Stable across processes and versions (not Python's salted hash)."""
    return xxhash.xxh3_64_intdigest(worker_id.encode()) % shards


@dataclass(frozen=True, slots=True)
class ShardKeys:
    shard: int

    @property
    def tag(self) -> str:
        return f"kvroute:{{kvroute:s{self.shard:02d}}}"

    @property
    def stream(self) -> str:
        return f"{self.tag}:log"

    @property
    def counter(self) -> str:
        return f"{self.tag}:n"

    @property
    def snapshot(self) -> str:
        return f"{self.tag}:snap"

    @property
    def token(self) -> str:
        return f"{self.tag}:snap-token"

    def worker(self, worker_id: str) -> str:
        return f"{self.tag}:w:{worker_id}"

    def owner(self, worker_id: str) -> str:
        return f"{self.tag}:owner:{worker_id}"

    def for_worker(self, worker_id: str) -> list[str]:
        return [self.stream, self.counter, self.worker(worker_id), self.owner(worker_id)]


def parse_id(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)


@dataclass(slots=True)
class ShardTail:
    """How far this replica has applied one shard."""

    keys: ShardKeys
    position: bytes = NO_ID  # stream id of the last entry applied (or the snapshot's)
    n: int = 0  # its entry number
    head_at_start: bytes = NO_ID
    caught_up: bool = False
    reloads: int = 0


@dataclass(slots=True)
class RedisLogCounters:
    appended: int = 0
    applied: int = 0
    stale_entries: int = 0  # entries of an epoch that is not the worker's current one (not applied)
    out_of_sequence: int = 0  # batches not at last_seq + 1 (not applied)
    stale_epoch_refusals: int = 0
    redis_errors: int = 0
    shard_reloads: int = 0  # gaps in a shard's entry numbers: reloaded from its snapshot
    expiries: int = 0  # expire entries this replica appended
    snapshots_written: int = 0
    snapshot_refusals: int = 0  # snapshot writes refused (an older token or an older position)
    snapshot_skips: int = 0  # shards not written: a worker there lost entries to --max-index-entries
    snapshots_loaded: int = 0  # worker snapshots applied at start or on a reload


@dataclass
class RedisLogConfig:
    shards: int = 16
    replica_id: str = ""
    snapshot_interval_s: float = 10.0
    lease_ttl_s: float = 10.0
    read_count: int = 1000  # entries per XREAD
    block_ms: int = 1000  # XREAD BLOCK
    unreachable_after_s: float = 1.0  # no successful Redis call for this long: degraded


@dataclass
class _Health:
    last_ok: float = 0.0
    last_error: str = ""
    failing_since: float = 0.0


class RedisEventLog:
    """EventLog over Redis Streams (see the module docstring). `start()` loads and catches up."""

    def __init__(self, applier: LogApplier, redis, config: RedisLogConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.applier = applier
        self.registry = applier.registry
        self.redis = redis
        self.config = config
        self.clock = clock
        self.counters = RedisLogCounters()
        self.shards = [ShardTail(ShardKeys(s)) for s in range(config.shards)]
        self.epochs: dict[str, int] = {}  # worker id -> current epoch, as applied
        self.health = _Health()
        self.loaded = False
        self._register = redis.register_script(REGISTER)
        self._append = redis.register_script(APPEND)
        self._expire = redis.register_script(EXPIRE)
        self._release = redis.register_script(RELEASE)
        self._write_snapshot = redis.register_script(WRITE_SNAPSHOT)
        self._renew_lease = redis.register_script(RENEW_LEASE)
        self._release_lease = redis.register_script(RELEASE_LEASE)
        self._tasks: list[asyncio.Task] = []
        self._lease_token = 0
        self._caught_up = asyncio.Event()
        self._stopping = False
        self._closed = False

    @property
    def heartbeat_timeout_s(self) -> float:
        return self.registry.heartbeat_timeout_s

    # ------------------------------------------------------------ state

    @property
    def ready(self) -> bool:
        """Loaded and caught up with every shard's head as seen at start."""
        return self.loaded and all(t.caught_up for t in self.shards)

    @property
    def redis_ok(self) -> bool:
        return self.health.last_ok > 0 and not self.health.failing_since

    def problems(self) -> list[str]:
        out = []
        if not self.loaded:
            out.append("loading the log from Redis")
        elif not self.ready:
            behind = [t.keys.shard for t in self.shards if not t.caught_up]
            out.append(f"catching up with the log ({len(behind)} of {len(self.shards)} shards behind)")
        if self.health.failing_since:
            out.append(f"redis unreachable for {self.clock() - self.health.failing_since:.1f}s: {self.health.last_error}")
        return out

    def _ok(self) -> None:
        self.health.last_ok = self.clock()
        if self.health.failing_since:
            log.info("redis reachable again after %.1fs", self.clock() - self.health.failing_since)
        self.health.failing_since = 0.0

    def _failed(self, exc: BaseException) -> None:
        raise_if_cancelled()
        if self._stopping:
            raise asyncio.CancelledError()
        self.counters.redis_errors += 1
        self.health.last_error = f"{type(exc).__name__}: {exc}"
        if not self.health.failing_since:
            self.health.failing_since = self.clock()
            log.warning("redis call failed: %s", self.health.last_error)

    def keys_of(self, worker_id: str) -> ShardKeys:
        return self.shards[shard_of(worker_id, len(self.shards))].keys

    # ------------------------------------------------------------ start / stop

    async def start(self) -> None:
        """Check the shard count, then load and tail in the background (`ready` when caught up)."""
        self._tasks.append(asyncio.create_task(self._load_and_tail(), name="kvroute-redis-log"))
        self._tasks.append(asyncio.create_task(self._snapshot_forever(), name="kvroute-redis-snapshots"))

    async def stop(self) -> None:
        self._stopping = True
        for task in await cancel_and_wait(*self._tasks, timeout_s=2.0):
            log.error("task %s did not stop when cancelled", task.get_name())
        if not self._tasks and self._closed:
            return
        self._tasks.clear()
        self._closed = True
        try:  # bounded: redis-py's close can wait on a connection whose blocking read was cancelled
            await asyncio.wait_for(self.redis.aclose(), 1.0)
        except Exception as exc:  # noqa: BLE001 - closing a client whose server is gone
            log.debug("closing the redis client: %r", exc)

    async def wait_ready(self, timeout_s: float | None) -> bool:
        """Whether the log got caught up within `timeout_s` (None: wait as long as it takes)."""
        try:
            await asyncio.wait_for(self._caught_up.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def _load_and_tail(self) -> None:
        backoff = redis_backoff()
        while True:  # Redis may be down at start: keep trying, never crash
            try:
                await self._check_shard_count()
                for tail in self.shards:
                    last = await self.redis.xrevrange(tail.keys.stream, count=1)
                    tail.head_at_start = last[0][0] if last else NO_ID
                for tail in self.shards:
                    await self._load_shard(tail)
                self._ok()
                break
            except (RedisError, OSError) as exc:
                self._failed(exc)
                await backoff.sleep()
        self.loaded = True
        for tail in self.shards:
            self._mark_caught_up(tail)
            self._tasks.append(asyncio.create_task(self._tail_forever(tail), name=f"kvroute-tail-{tail.keys.shard}"))

    async def _check_shard_count(self) -> None:
        key = f"{META}:shards"
        await self.redis.set(key, len(self.shards), nx=True)
        stored = int(await self.redis.get(key))
        if stored != len(self.shards):
            raise SystemExit(
                f"kvroute control-plane: error: --redis-shards {len(self.shards)} but the replicas "
                f"sharing this Redis use {stored}; start every replica with the same count"
            )

    def _mark_caught_up(self, tail: ShardTail) -> None:
        if not tail.caught_up and parse_id(tail.position) >= parse_id(tail.head_at_start):
            tail.caught_up = True
            if self.ready:
                self._caught_up.set()
                log.info(
                    "caught up with the log: %d workers, %d index entries", len(self.registry), self.registry.index.entry_count()
                )

    # ------------------------------------------------------------ loading

    async def _load_shard(self, tail: ShardTail) -> None:
        """Replace this replica's state of the shard's workers by the shard's snapshot."""
        fields = await self.redis.hgetall(tail.keys.snapshot)
        position = fields.pop(b"__id", NO_ID)
        n = int(fields.pop(b"__n", b"0"))
        snapshots = {worker_id.decode(): SNAPSHOT_DECODER.decode(blob) for worker_id, blob in fields.items()}
        shard = tail.keys.shard
        for record in list(self.registry.workers()):
            if shard_of(record.worker_id, len(self.shards)) == shard and record.worker_id not in snapshots:
                self.applier.drop(record.worker_id)
                self.epochs.pop(record.worker_id, None)
        for worker_id, snap in snapshots.items():
            self.applier.restore(snap)
            self.epochs[worker_id] = snap.epoch
            self.counters.snapshots_loaded += 1
        tail.position, tail.n = position, n

    # ------------------------------------------------------------ tailing

    async def _tail_forever(self, tail: ShardTail) -> None:
        backoff = redis_backoff()
        stream = tail.keys.stream
        while True:
            try:
                reply = await self.redis.xread({stream: tail.position}, count=self.config.read_count, block=self.config.block_ms)
                if self._stopping:
                    return
                self._ok()
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                self._failed(exc)
                await backoff.sleep()
                continue
            for _, entries in reply or ():
                for entry_id, fields in entries:
                    n = int(fields[b"n"])
                    if n != tail.n + 1:
                        await self._reload(tail, n)
                        break
                    self._apply(fields)
                    tail.position, tail.n = entry_id, n
            self._mark_caught_up(tail)

    async def _reload(self, tail: ShardTail, n: int) -> None:
        """Entries between ours and `n` are gone (trimmed while we were away, or Redis restarted empty)."""
        log.warning("shard %d: entry %d follows %d: reloading the shard from its snapshot", tail.keys.shard, n, tail.n)
        self.counters.shard_reloads += 1
        tail.reloads += 1
        backoff = redis_backoff()
        while True:
            try:
                await self._load_shard(tail)
                return
            except (RedisError, OSError) as exc:
                self._failed(exc)
                await backoff.sleep()

    def _apply(self, fields: dict[bytes, bytes]) -> None:
        kind, worker_id, epoch = fields[b"t"], fields[b"w"].decode(), int(fields[b"e"])
        self.counters.applied += 1
        if kind == KIND_REGISTER:
            if epoch <= self.epochs.get(worker_id, 0):
                self.counters.stale_entries += 1
                return
            self.epochs[worker_id] = epoch
            self.applier.register(worker_id, REGISTER_DECODER.decode(fields[b"d"]), resume=fields[b"r"] == b"1")
            return
        if kind == KIND_EXPIRE:
            self.epochs[worker_id] = epoch
            if self.applier.drop(worker_id, expired=True):
                log.warning(
                    "worker %s expired (no heartbeat for %.1fs): dropped with its blocks", worker_id, self.heartbeat_timeout_s
                )
            return
        record = self.registry.get(worker_id)
        if record is None or self.epochs.get(worker_id) != epoch:
            self.counters.stale_entries += 1
            return
        if kind == KIND_BATCH or kind == KIND_PB_BATCH:
            seq = int(fields[b"s"])
            if seq != record.last_seq + 1:
                self.counters.out_of_sequence += 1
                return
            if kind == KIND_PB_BATCH:
                batch = pb.EventBatch.FromString(fields[b"d"])
                self.applier.apply_batch(record, seq, batch.snapshot, ops_from_events(batch.events, tier_or_disk))
            else:
                body = BATCH_DECODER.decode(fields[b"d"])
                self.applier.apply_batch(record, seq, body.snapshot, unpack_ops(body.ops))
            self.registry.touch(record)
        elif kind == KIND_HEARTBEAT:
            self.applier.heartbeat(record, HEARTBEAT_DECODER.decode(fields[b"d"]))

    # ------------------------------------------------------------ agent side (EventLog)

    def _owner_value(self, session_instance: str, peer: str) -> str:
        return f"{session_instance}|{peer} via replica {self.config.replica_id}"

    def _unavailable(self, exc: BaseException) -> LogRefusal:
        self._failed(exc)
        return LogRefusal(
            grpc.StatusCode.UNAVAILABLE,
            "redis_unreachable",
            f"control plane replica {self.config.replica_id}: redis unreachable ({type(exc).__name__}); try another replica",
        )

    async def register(self, req: pb.RegisterWorker, peer: str) -> AgentSession:
        check_register(req)
        if not self.ready:
            raise LogRefusal(
                grpc.StatusCode.UNAVAILABLE,
                "not_ready",
                f"control plane replica {self.config.replica_id} is catching up with the log; try another replica",
            )
        keys = self.keys_of(req.worker_id)
        owner = self._owner_value(req.agent_instance, peer)
        body = ENCODER.encode(register_body(req, peer))
        try:
            reply = await self._register(
                keys=keys.for_worker(req.worker_id),
                args=[req.worker_id, req.agent_instance, owner, int(self.heartbeat_timeout_s * 1000), body],
            )
        except (RedisError, OSError) as exc:
            raise self._unavailable(exc) from None
        self._ok()
        if reply[0] == b"in_use":
            raise LogRefusal(
                grpc.StatusCode.ALREADY_EXISTS,
                "worker_id_in_use",
                in_use_detail(req.worker_id, reply[1].decode(errors="replace"), peer),
            )
        _, epoch, seq, resume = reply
        self.counters.appended += 1
        return AgentSession(req.worker_id, int(epoch), req.agent_instance, bool(resume), int(seq), peer, owner=owner)

    async def _append_entry(self, session: AgentSession, kind: bytes, seq: int, body: bytes) -> None:
        keys = self.keys_of(session.worker_id)
        try:
            reply = await self._append(
                keys=keys.for_worker(session.worker_id),
                args=[session.worker_id, session.epoch, kind, seq, session.owner, int(self.heartbeat_timeout_s * 1000), body],
            )
        except (RedisError, OSError) as exc:
            raise self._unavailable(exc) from None
        self._ok()
        if reply[0] == b"stale":
            self.counters.stale_epoch_refusals += 1
            raise LogRefusal(
                grpc.StatusCode.ABORTED,
                "stale_epoch",
                f"worker {session.worker_id!r}: epoch {session.epoch} is no longer current (now "
                f"{reply[1].decode()}): another agent registered this worker id, or it expired; reconnect",
            )
        if reply[0] == b"sequence":
            raise LogRefusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                "sequence",
                f"worker {session.worker_id!r}: expected batch seq {int(reply[1]) + 1}, got {seq}; reconnect and send a snapshot",
            )
        self.counters.appended += 1

    async def append_batch(
        self, session: AgentSession, seq: int, snapshot: bool, ops: list[BlockOp], source: pb.EventBatch | None = None
    ) -> None:
        if source is not None:  # protobuf's C serializer: no Python loop over the keys
            await self._append_entry(session, KIND_PB_BATCH, seq, source.SerializeToString())
        else:
            await self._append_entry(session, KIND_BATCH, seq, ENCODER.encode(BatchBody(snapshot, pack_ops(ops))))

    async def heartbeat(self, session: AgentSession, body: HeartbeatBody) -> None:
        await self._append_entry(session, KIND_HEARTBEAT, 0, ENCODER.encode(body))

    async def release(self, session: AgentSession) -> None:
        keys = self.keys_of(session.worker_id)
        try:
            await self._release(
                keys=[keys.worker(session.worker_id), keys.owner(session.worker_id)], args=[session.epoch, session.owner]
            )
        except (RedisError, OSError) as exc:
            self._failed(exc)  # the owner key then lapses by its TTL

    async def expire_silent(self) -> list[str]:
        """Ask Redis to expire workers silent here past the heartbeat timeout; the drop itself happens
        when the expire entry is applied, on every replica alike."""
        if not self.ready:
            return []
        deadline = self.clock() - self.heartbeat_timeout_s
        for record in [r for r in self.registry.workers() if r.last_seen < deadline]:
            keys = self.keys_of(record.worker_id)
            try:
                if await self._expire(
                    keys=keys.for_worker(record.worker_id), args=[record.worker_id, self.epochs.get(record.worker_id, 0)]
                ):
                    self.counters.expiries += 1
                self._ok()
            except (RedisError, OSError) as exc:
                self._failed(exc)
                break
        return []

    # ------------------------------------------------------------ snapshots

    def _evicted(self, record: WorkerRecord) -> bool:
        """The worker lost entries to this replica's bound (--max-index-entries) since its last snapshot:
        this replica no longer knows its whole state, so it must not write a snapshot of it (the log
        behind it would be trimmed, and every replica that loads it would lose what this one dropped)."""
        return bool(self.registry.index.evicted_entries(record.slot))

    async def _snapshot_forever(self) -> None:
        lease_key, token_key = f"{META}:snapshot-lease", f"{META}:snapshot-token"
        ttl_ms = int(self.config.lease_ttl_s * 1000)
        renew_every = self.config.lease_ttl_s / 5
        next_snapshot = self.clock() + self.config.snapshot_interval_s
        holding = evicted = False
        while True:
            await asyncio.sleep(min(renew_every, self.config.snapshot_interval_s))
            if not self.ready:
                continue
            try:
                now_evicted = any(self._evicted(r) for r in self.registry.workers())
                if now_evicted != evicted:
                    evicted = now_evicted
                    log.warning(
                        "this replica's index dropped entries for --max-index-entries: it leaves snapshots "
                        "to replicas without evictions (if none, the log is not trimmed)"
                        if evicted
                        else "no worker lacks entries here any more (each sent a snapshot or left): this replica "
                        "may write snapshots again"
                    )
                if evicted:  # leave snapshots to a replica that knows every worker's whole state
                    if holding:
                        holding = False
                        await self._release_lease(keys=[lease_key], args=[self.config.replica_id])
                    continue
                if holding:
                    holding = bool(await self._renew_lease(keys=[lease_key], args=[self.config.replica_id, ttl_ms]))
                    if not holding:
                        log.info("snapshot lease lost")
                if not holding and await self.redis.set(lease_key, self.config.replica_id, nx=True, px=ttl_ms):
                    self._lease_token = int(await self.redis.incr(token_key))
                    holding = True
                    log.info("snapshot lease taken (token %d)", self._lease_token)
                if holding and self.clock() >= next_snapshot:
                    await self.write_snapshots()
                    next_snapshot = self.clock() + self.config.snapshot_interval_s
                self._ok()
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                self._failed(exc)
                holding = False

    async def write_snapshots(self, token: int | None = None) -> int:
        """Write every shard's snapshot at the position applied here and trim behind it; returns how
        many shards were written (a shard refused: a newer token or position is already there; skipped:
        one of its workers lost entries to this replica's bound)."""
        token = self._lease_token if token is None else token
        written = 0
        for tail in self.shards:
            if tail.position == NO_ID:
                continue
            # Built without an await in between: exactly the state at tail.position.
            shard, args = tail.keys.shard, [token, tail.position, tail.n]
            records = [r for r in self.registry.workers() if shard_of(r.worker_id, len(self.shards)) == shard]
            if any(self._evicted(record) for record in records):
                self.counters.snapshot_skips += 1
                continue
            for record in records:
                args += [record.worker_id, ENCODER.encode(self.applier.snapshot_of(record, self.epochs.get(record.worker_id, 0)))]
            keys = [tail.keys.snapshot, tail.keys.token, tail.keys.stream]
            if await self._write_snapshot(keys=keys, args=args):
                written += 1
                self.counters.snapshots_written += 1
            else:
                self.counters.snapshot_refusals += 1
        return written
