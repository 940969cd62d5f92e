from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_GPU: _ClassVar[Tier]
    TIER_CPU: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]

class BlockOpKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCKS_STORED: _ClassVar[BlockOpKind]
    BLOCKS_REMOVED: _ClassVar[BlockOpKind]
    BLOCKS_CLEARED: _ClassVar[BlockOpKind]

class RouterChangeKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUTER_SESSION_OPENED: _ClassVar[RouterChangeKind]
    ROUTER_RESERVED: _ClassVar[RouterChangeKind]
    ROUTER_PREFILL_DONE: _ClassVar[RouterChangeKind]
    ROUTER_RELEASED: _ClassVar[RouterChangeKind]
    ROUTER_SESSION_CLOSED: _ClassVar[RouterChangeKind]

class RequestOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_OUTCOME_UNSPECIFIED: _ClassVar[RequestOutcome]
    REQUEST_OUTCOME_COMPLETED: _ClassVar[RequestOutcome]
    REQUEST_OUTCOME_FAILED: _ClassVar[RequestOutcome]
    REQUEST_OUTCOME_CANCELLED: _ClassVar[RequestOutcome]
TIER_GPU: Tier
TIER_CPU: Tier
TIER_DISK: Tier
BLOCKS_STORED: BlockOpKind
BLOCKS_REMOVED: BlockOpKind
BLOCKS_CLEARED: BlockOpKind
ROUTER_SESSION_OPENED: RouterChangeKind
ROUTER_RESERVED: RouterChangeKind
ROUTER_PREFILL_DONE: RouterChangeKind
ROUTER_RELEASED: RouterChangeKind
ROUTER_SESSION_CLOSED: RouterChangeKind
REQUEST_OUTCOME_UNSPECIFIED: RequestOutcome
REQUEST_OUTCOME_COMPLETED: RequestOutcome
REQUEST_OUTCOME_FAILED: RequestOutcome
REQUEST_OUTCOME_CANCELLED: RequestOutcome

class AgentMessage(_message.Message):
    __slots__ = ("register", "batch", "heartbeat")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    register: RegisterWorker
    batch: EventBatch
    heartbeat: Heartbeat
    def __init__(self, register: _Optional[_Union[RegisterWorker, _Mapping]] = ..., batch: _Optional[_Union[EventBatch, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...

class RegisterWorker(_message.Message):
    __slots__ = ("worker_id", "model", "engine", "block_size", "endpoint", "engine_version", "lora_adapters", "data_parallel_rank", "agent_instance", "acked_seq", "role")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    AGENT_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQ_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    engine: str
    block_size: int
    endpoint: str
    engine_version: str
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    data_parallel_rank: int
    agent_instance: str
    acked_seq: int
    role: str
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., engine: _Optional[str] = ..., block_size: _Optional[int] = ..., endpoint: _Optional[str] = ..., engine_version: _Optional[str] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., data_parallel_rank: _Optional[int] = ..., agent_instance: _Optional[str] = ..., acked_seq: _Optional[int] = ..., role: _Optional[str] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("seq", "snapshot", "events", "traceparent")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    snapshot: bool
    events: _containers.RepeatedCompositeFieldContainer[BlockEvent]
    traceparent: str
    def __init__(self, seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[BlockEvent, _Mapping]]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class BlockEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlocksStored
    removed: BlocksRemoved
    cleared: AllBlocksCleared
    def __init__(self, stored: _Optional[_Union[BlocksStored, _Mapping]] = ..., removed: _Optional[_Union[BlocksRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class BlocksStored(_message.Message):
    __slots__ = ("block_keys", "tier")
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    tier: Tier
    def __init__(self, block_keys: _Optional[_Iterable[int]] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class BlocksRemoved(_message.Message):
    __slots__ = ("block_keys", "tier")
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    tier: Tier
    def __init__(self, block_keys: _Optional[_Iterable[int]] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("load", "lora_adapters")
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    load: WorkerLoad
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., lora_adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "kv_usage", "observed_unix_ms", "kv_capacity_tokens")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    kv_usage: float
    observed_unix_ms: int
    kv_capacity_tokens: int
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_usage: _Optional[float] = ..., observed_unix_ms: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ...) -> None: ...

class ControlMessage(_message.Message):
    __slots__ = ("registered", "ack")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    registered: Registered
    ack: Ack
    def __init__(self, registered: _Optional[_Union[Registered, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ...) -> None: ...

class Registered(_message.Message):
    __slots__ = ("worker_id", "heartbeat_timeout_ms", "epoch", "resume", "last_seq")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    heartbeat_timeout_ms: int
    epoch: int
    resume: bool
    last_seq: int
    def __init__(self, worker_id: _Optional[str] = ..., heartbeat_timeout_ms: _Optional[int] = ..., epoch: _Optional[int] = ..., resume: _Optional[bool] = ..., last_seq: _Optional[int] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("seq", "applied_events")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    APPLIED_EVENTS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    applied_events: int
    def __init__(self, seq: _Optional[int] = ..., applied_events: _Optional[int] = ...) -> None: ...

class KeyChain(_message.Message):
    __slots__ = ("block_size", "block_keys")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_size: _Optional[int] = ..., block_keys: _Optional[_Iterable[int]] = ...) -> None: ...

class QueryRequest(_message.Message):
    __slots__ = ("model", "chains", "query_id", "lora_name", "columnar")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHAINS_FIELD_NUMBER: _ClassVar[int]
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    COLUMNAR_FIELD_NUMBER: _ClassVar[int]
    model: str
    chains: _containers.RepeatedCompositeFieldContainer[KeyChain]
    query_id: int
    lora_name: str
    columnar: bool
    def __init__(self, model: _Optional[str] = ..., chains: _Optional[_Iterable[_Union[KeyChain, _Mapping]]] = ..., query_id: _Optional[int] = ..., lora_name: _Optional[str] = ..., columnar: _Optional[bool] = ...) -> None: ...

class WorkerMatch(_message.Message):
    __slots__ = ("worker_id", "endpoint", "block_size", "matched_blocks", "load", "cpu_blocks", "disk_blocks", "speculative_blocks", "reserved_requests", "reserved_prefill_tokens", "data_parallel_rank")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    endpoint: str
    block_size: int
    matched_blocks: int
    load: WorkerLoad
    cpu_blocks: int
    disk_blocks: int
    speculative_blocks: int
    reserved_requests: int
    reserved_prefill_tokens: int
    data_parallel_rank: int
    def __init__(self, worker_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., block_size: _Optional[int] = ..., matched_blocks: _Optional[int] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., cpu_blocks: _Optional[int] = ..., disk_blocks: _Optional[int] = ..., speculative_blocks: _Optional[int] = ..., reserved_requests: _Optional[int] = ..., reserved_prefill_tokens: _Optional[int] = ..., data_parallel_rank: _Optional[int] = ...) -> None: ...

class QueryResponse(_message.Message):
    __slots__ = ("workers", "query_id", "columns")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerMatch]
    query_id: int
    columns: WorkerColumns
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerMatch, _Mapping]]] = ..., query_id: _Optional[int] = ..., columns: _Optional[_Union[WorkerColumns, _Mapping]] = ...) -> None: ...

class WorkerColumns(_message.Message):
    __slots__ = ("worker_id", "matched_blocks", "cpu_blocks", "disk_blocks", "speculative_blocks", "reserved_requests", "reserved_prefill_tokens", "running_requests", "waiting_requests", "kv_usage", "cached_blocks", "kv_capacity_tokens", "other_routers")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OTHER_ROUTERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: _containers.RepeatedScalarFieldContainer[str]
    matched_blocks: _containers.RepeatedScalarFieldContainer[int]
    cpu_blocks: _containers.RepeatedScalarFieldContainer[int]
    disk_blocks: _containers.RepeatedScalarFieldContainer[int]
    speculative_blocks: _containers.RepeatedScalarFieldContainer[int]
    reserved_requests: _containers.RepeatedScalarFieldContainer[int]
    reserved_prefill_tokens: _containers.RepeatedScalarFieldContainer[int]
    running_requests: _containers.RepeatedScalarFieldContainer[int]
    waiting_requests: _containers.RepeatedScalarFieldContainer[int]
    kv_usage: _containers.RepeatedScalarFieldContainer[float]
    cached_blocks: _containers.RepeatedScalarFieldContainer[int]
    kv_capacity_tokens: _containers.RepeatedScalarFieldContainer[int]
    other_routers: int
    def __init__(self, worker_id: _Optional[_Iterable[str]] = ..., matched_blocks: _Optional[_Iterable[int]] = ..., cpu_blocks: _Optional[_Iterable[int]] = ..., disk_blocks: _Optional[_Iterable[int]] = ..., speculative_blocks: _Optional[_Iterable[int]] = ..., reserved_requests: _Optional[_Iterable[int]] = ..., reserved_prefill_tokens: _Optional[_Iterable[int]] = ..., running_requests: _Optional[_Iterable[int]] = ..., waiting_requests: _Optional[_Iterable[int]] = ..., kv_usage: _Optional[_Iterable[float]] = ..., cached_blocks: _Optional[_Iterable[int]] = ..., kv_capacity_tokens: _Optional[_Iterable[int]] = ..., other_routers: _Optional[int] = ...) -> None: ...

class RouterMessage(_message.Message):
    __slots__ = ("hello", "query", "reserve", "prefill_done", "release", "ops")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DONE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    hello: RouterHello
    query: QueryRequest
    reserve: Reservation
    prefill_done: ReservationDone
    release: ReservationDone
    ops: RouterOps
    def __init__(self, hello: _Optional[_Union[RouterHello, _Mapping]] = ..., query: _Optional[_Union[QueryRequest, _Mapping]] = ..., reserve: _Optional[_Union[Reservation, _Mapping]] = ..., prefill_done: _Optional[_Union[ReservationDone, _Mapping]] = ..., release: _Optional[_Union[ReservationDone, _Mapping]] = ..., ops: _Optional[_Union[RouterOps, _Mapping]] = ...) -> None: ...

class RouterOps(_message.Message):
    __slots__ = ("reserve", "prefill_done", "release")
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DONE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    reserve: _containers.RepeatedCompositeFieldContainer[Reservation]
    prefill_done: _containers.RepeatedScalarFieldContainer[int]
    release: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, reserve: _Optional[_Iterable[_Union[Reservation, _Mapping]]] = ..., prefill_done: _Optional[_Iterable[int]] = ..., release: _Optional[_Iterable[int]] = ...) -> None: ...

class RouterHello(_message.Message):
    __slots__ = ("router_id",)
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    def __init__(self, router_id: _Optional[str] = ...) -> None: ...

class Reservation(_message.Message):
    __slots__ = ("reservation_id", "worker_id", "block_size", "block_keys", "prefill_tokens", "ttl_ms", "prompt_tokens")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    worker_id: str
    block_size: int
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    prefill_tokens: int
    ttl_ms: int
    prompt_tokens: int
    def __init__(self, reservation_id: _Optional[int] = ..., worker_id: _Optional[str] = ..., block_size: _Optional[int] = ..., block_keys: _Optional[_Iterable[int]] = ..., prefill_tokens: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class ReservationDone(_message.Message):
    __slots__ = ("reservation_id",)
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    def __init__(self, reservation_id: _Optional[int] = ...) -> None: ...

class RouterReply(_message.Message):
    __slots__ = ("welcome", "result", "trimmed")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    TRIMMED_FIELD_NUMBER: _ClassVar[int]
    welcome: RouterWelcome
    result: QueryResponse
    trimmed: ReservationTrimmed
    def __init__(self, welcome: _Optional[_Union[RouterWelcome, _Mapping]] = ..., result: _Optional[_Union[QueryResponse, _Mapping]] = ..., trimmed: _Optional[_Union[ReservationTrimmed, _Mapping]] = ...) -> None: ...

class ReservationTrimmed(_message.Message):
    __slots__ = ("reservation_id", "prefill_tokens")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    prefill_tokens: int
    def __init__(self, reservation_id: _Optional[int] = ..., prefill_tokens: _Optional[int] = ...) -> None: ...

class RouterWelcome(_message.Message):
    __slots__ = ("router_id", "reservation_max_age_ms")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_MAX_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    reservation_max_age_ms: int
    def __init__(self, router_id: _Optional[str] = ..., reservation_max_age_ms: _Optional[int] = ...) -> None: ...

class GetWorkerKeysRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class TierKeys(_message.Message):
    __slots__ = ("block_keys", "tier")
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    tier: Tier
    def __init__(self, block_keys: _Optional[_Iterable[int]] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class GetWorkerKeysResponse(_message.Message):
    __slots__ = ("worker_id", "block_size", "tiers")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    block_size: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierKeys]
    def __init__(self, worker_id: _Optional[str] = ..., block_size: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierKeys, _Mapping]]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "model", "engine", "block_size", "endpoint", "load", "cached_blocks", "last_seq", "lora_adapters", "engine_version", "data_parallel_rank", "role")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    engine: str
    block_size: int
    endpoint: str
    load: WorkerLoad
    cached_blocks: int
    last_seq: int
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    engine_version: str
    data_parallel_rank: int
    role: str
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., engine: _Optional[str] = ..., block_size: _Optional[int] = ..., endpoint: _Optional[str] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., cached_blocks: _Optional[int] = ..., last_seq: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., engine_version: _Optional[str] = ..., data_parallel_rank: _Optional[int] = ..., role: _Optional[str] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class FollowRequest(_message.Message):
    __slots__ = ("router_id", "models", "resume_after", "leave_out_own")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    RESUME_AFTER_FIELD_NUMBER: _ClassVar[int]
    LEAVE_OUT_OWN_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    models: _containers.RepeatedScalarFieldContainer[str]
    resume_after: FollowPosition
    leave_out_own: bool
    def __init__(self, router_id: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., resume_after: _Optional[_Union[FollowPosition, _Mapping]] = ..., leave_out_own: _Optional[bool] = ...) -> None: ...

class FollowPosition(_message.Message):
    __slots__ = ("feed_id", "seq")
    FEED_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    feed_id: str
    seq: int
    def __init__(self, feed_id: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class FollowUpdate(_message.Message):
    __slots__ = ("position", "snapshot_begin", "snapshot_end", "changes", "sent_unix_us")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BEGIN_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_END_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_US_FIELD_NUMBER: _ClassVar[int]
    position: FollowPosition
    snapshot_begin: bool
    snapshot_end: bool
    changes: _containers.RepeatedCompositeFieldContainer[FleetChange]
    sent_unix_us: int
    def __init__(self, position: _Optional[_Union[FollowPosition, _Mapping]] = ..., snapshot_begin: _Optional[bool] = ..., snapshot_end: _Optional[bool] = ..., changes: _Optional[_Iterable[_Union[FleetChange, _Mapping]]] = ..., sent_unix_us: _Optional[int] = ...) -> None: ...

class FleetChange(_message.Message):
    __slots__ = ("applied_unix_us", "joined", "blocks", "heartbeat", "left", "router")
    APPLIED_UNIX_US_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    applied_unix_us: int
    joined: WorkerJoined
    blocks: WorkerBlocks
    heartbeat: WorkerHeartbeat
    left: WorkerLeft
    router: RouterChange
    def __init__(self, applied_unix_us: _Optional[int] = ..., joined: _Optional[_Union[WorkerJoined, _Mapping]] = ..., blocks: _Optional[_Union[WorkerBlocks, _Mapping]] = ..., heartbeat: _Optional[_Union[WorkerHeartbeat, _Mapping]] = ..., left: _Optional[_Union[WorkerLeft, _Mapping]] = ..., router: _Optional[_Union[RouterChange, _Mapping]] = ...) -> None: ...

class WorkerJoined(_message.Message):
    __slots__ = ("worker_id", "model", "engine", "block_size", "endpoint", "engine_version", "lora_adapters", "data_parallel_rank", "agent_instance", "resume", "role")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    AGENT_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    engine: str
    block_size: int
    endpoint: str
    engine_version: str
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    data_parallel_rank: int
    agent_instance: str
    resume: bool
    role: str
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., engine: _Optional[str] = ..., block_size: _Optional[int] = ..., endpoint: _Optional[str] = ..., engine_version: _Optional[str] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., data_parallel_rank: _Optional[int] = ..., agent_instance: _Optional[str] = ..., resume: _Optional[bool] = ..., role: _Optional[str] = ...) -> None: ...

class PackedBlockOp(_message.Message):
    __slots__ = ("kind", "tier", "keys")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    kind: BlockOpKind
    tier: Tier
    keys: bytes
    def __init__(self, kind: _Optional[_Union[BlockOpKind, str]] = ..., tier: _Optional[_Union[Tier, str]] = ..., keys: _Optional[bytes] = ...) -> None: ...

class WorkerBlocks(_message.Message):
    __slots__ = ("worker_id", "seq", "snapshot", "ops")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    seq: int
    snapshot: bool
    ops: _containers.RepeatedCompositeFieldContainer[PackedBlockOp]
    def __init__(self, worker_id: _Optional[str] = ..., seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., ops: _Optional[_Iterable[_Union[PackedBlockOp, _Mapping]]] = ...) -> None: ...

class WorkerHeartbeat(_message.Message):
    __slots__ = ("worker_id", "load", "lora_adapters")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    load: WorkerLoad
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_id: _Optional[str] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., lora_adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class WorkerLeft(_message.Message):
    __slots__ = ("worker_id", "expired")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    expired: bool
    def __init__(self, worker_id: _Optional[str] = ..., expired: _Optional[bool] = ...) -> None: ...

class RouterChange(_message.Message):
    __slots__ = ("kind", "origin", "session", "router_id", "reservation_id", "worker_id", "block_size", "keys", "prefill_tokens", "ttl_ms")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    kind: RouterChangeKind
    origin: str
    session: int
    router_id: str
    reservation_id: int
    worker_id: str
    block_size: int
    keys: bytes
    prefill_tokens: int
    ttl_ms: int
    def __init__(self, kind: _Optional[_Union[RouterChangeKind, str]] = ..., origin: _Optional[str] = ..., session: _Optional[int] = ..., router_id: _Optional[str] = ..., reservation_id: _Optional[int] = ..., worker_id: _Optional[str] = ..., block_size: _Optional[int] = ..., keys: _Optional[bytes] = ..., prefill_tokens: _Optional[int] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class ReservationRef(_message.Message):
    __slots__ = ("reservation_id",)
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    def __init__(self, reservation_id: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("reservation_id", "outcome")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    outcome: RequestOutcome
    def __init__(self, reservation_id: _Optional[int] = ..., outcome: _Optional[_Union[RequestOutcome, str]] = ...) -> None: ...

class ReservationState(_message.Message):
    __slots__ = ("reservation_id", "was_held")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    WAS_HELD_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    was_held: bool
    def __init__(self, reservation_id: _Optional[int] = ..., was_held: _Optional[bool] = ...) -> None: ...

class ToolDefinition(_message.Message):
    __slots__ = ("type", "name", "description", "parameters_json")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    type: str
    name: str
    description: str
    parameters_json: str
    def __init__(self, type: _Optional[str] = ..., name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("type", "text")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    type: str
    text: str
    def __init__(self, type: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "parts", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    parts: _containers.RepeatedCompositeFieldContainer[ContentPart]
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ..., name: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("model", "prompt", "token_ids", "messages", "lora_name", "cache_salt", "explain", "session_id", "reserve", "reservation_ttl_ms", "tools")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    token_ids: TokenIds
    messages: ChatMessages
    lora_name: str
    cache_salt: str
    explain: bool
    session_id: str
    reserve: bool
    reservation_ttl_ms: int
    tools: _containers.RepeatedCompositeFieldContainer[ToolDefinition]
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., lora_name: _Optional[str] = ..., cache_salt: _Optional[str] = ..., explain: _Optional[bool] = ..., session_id: _Optional[str] = ..., reserve: _Optional[bool] = ..., reservation_ttl_ms: _Optional[int] = ..., tools: _Optional[_Iterable[_Union[ToolDefinition, _Mapping]]] = ...) -> None: ...

class WorkerScore(_message.Message):
    __slots__ = ("worker_id", "endpoint", "cached_tokens", "score", "load", "inflight_requests")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    endpoint: str
    cached_tokens: int
    score: float
    load: WorkerLoad
    inflight_requests: int
    def __init__(self, worker_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., score: _Optional[float] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., inflight_requests: _Optional[int] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("worker_id", "endpoint", "prompt_tokens", "cached_tokens", "workers", "policy", "fail_open", "explanation", "reservation_id", "reservation_ttl_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    FAIL_OPEN_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    endpoint: str
    prompt_tokens: int
    cached_tokens: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerScore]
    policy: str
    fail_open: bool
    explanation: DecisionExplanation
    reservation_id: int
    reservation_ttl_ms: int
    def __init__(self, worker_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerScore, _Mapping]]] = ..., policy: _Optional[str] = ..., fail_open: _Optional[bool] = ..., explanation: _Optional[_Union[DecisionExplanation, _Mapping]] = ..., reservation_id: _Optional[int] = ..., reservation_ttl_ms: _Optional[int] = ...) -> None: ...

class DecisionExplanation(_message.Message):
    __slots__ = ("policy", "reason", "workers", "params", "fail_open_reason")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    FAIL_OPEN_REASON_FIELD_NUMBER: _ClassVar[int]
    policy: str
    reason: str
    workers: _containers.RepeatedCompositeFieldContainer[CandidateExplanation]
    params: _containers.ScalarMap[str, float]
    fail_open_reason: str
    def __init__(self, policy: _Optional[str] = ..., reason: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[CandidateExplanation, _Mapping]]] = ..., params: _Optional[_Mapping[str, float]] = ..., fail_open_reason: _Optional[str] = ...) -> None: ...

class CandidateExplanation(_message.Message):
    __slots__ = ("worker_id", "cost", "terms", "credited_tokens", "within_load_bound", "in_spread_pool", "index")
    class TermsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    TERMS_FIELD_NUMBER: _ClassVar[int]
    CREDITED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WITHIN_LOAD_BOUND_FIELD_NUMBER: _ClassVar[int]
    IN_SPREAD_POOL_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    cost: float
    terms: _containers.ScalarMap[str, float]
    credited_tokens: float
    within_load_bound: bool
    in_spread_pool: bool
    index: IndexMatch
    def __init__(self, worker_id: _Optional[str] = ..., cost: _Optional[float] = ..., terms: _Optional[_Mapping[str, float]] = ..., credited_tokens: _Optional[float] = ..., within_load_bound: _Optional[bool] = ..., in_spread_pool: _Optional[bool] = ..., index: _Optional[_Union[IndexMatch, _Mapping]] = ...) -> None: ...

class IndexMatch(_message.Message):
    __slots__ = ("matched_tokens", "cpu_tokens", "disk_tokens", "other_routers_requests", "other_routers_prefill_tokens")
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CPU_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OTHER_ROUTERS_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    OTHER_ROUTERS_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    matched_tokens: int
    cpu_tokens: int
    disk_tokens: int
    other_routers_requests: int
    other_routers_prefill_tokens: int
    def __init__(self, matched_tokens: _Optional[int] = ..., cpu_tokens: _Optional[int] = ..., disk_tokens: _Optional[int] = ..., other_routers_requests: _Optional[int] = ..., other_routers_prefill_tokens: _Optional[int] = ...) -> None: ...
