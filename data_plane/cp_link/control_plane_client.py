"""The router's view of the control plane: a deadline-bounded `Query` plus a background
`ListWorkers` refresher that keeps the known fleet (ids, endpoints, block sizes, load).

The known fleet is what lets a slow or dead control plane degrade routing to load-only instead
of to errors (`kvroute.data_plane.service.routing` does the failing open):

- `workers_for(model)` is the latest `ListWorkers` snapshot for the model; if that is empty (a
  restarted control plane whose agents have not re-registered yet) it is the last non-empty
  snapshot; if the control plane has never answered, the `--static-workers` fleet. Engines found
  by DNS (`--discover-engines`, `engine_discovery.py`) follow, in every case and in both index
  modes, except those an agent reports on (the same endpoint: one worker, the agent's).
- `query()` goes over the router session stream when it is open (`router_session.py`, which also
  carries this router's in-flight reservations), else the unary Query RPC; it raises on timeout
  or error (TimeoutError, grpc.aio.AioRpcError).

Several replicas (`--control-plane A,B,C`, or a name resolving to several: `kvroute.addresses`): the
client keeps a channel to each and uses one, `address`. When it fails (session lost, a refresh or a
unary query answered UNAVAILABLE or not at all) the client moves to the next at once: the session
reconnects there without a pause, and a unary query tries the next replicas within what is left of
its deadline, so a dead replica costs at most one query deadline of load-only routing. A replica that
failed is skipped by failovers for `DOWN_S` unless every replica failed; a query that is merely late
(DEADLINE_EXCEEDED) moves nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from kvroute.addresses import AddressRotation
from kvroute.aio import cancel_and_wait
from kvroute.data_plane.cp_link.fleet_view import FleetFollower, FleetView
from kvroute.data_plane.cp_link.query_deadline import QueryDeadline
from kvroute.data_plane.cp_link.router_session import RouterSessionLink, SessionUnavailable
from kvroute.rate_limited_log import RateLimitedLog
from kvroute.tls import ClientTls, grpc_message_options, open_channel, rpc_failure_reason
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from kvroute.data_plane.engines.engine_discovery import EngineDiscovery

log = logging.getLogger("kvroute.router.cp")
RETIRE_GRACE_S = 30.0  # channels opened with certificates since rotated stay this long for calls in progress
DOWN_S = 2.0  # a replica that failed is not picked again by a failover for this long (unless all failed)


@dataclass(slots=True)
class KnownWorker:
    worker_id: str
    model: str  # "" for a worker no agent reports on (static, found by DNS): serves whatever the router serves
    endpoint: str
    block_size: int
    load: pb.WorkerLoad
    cached_blocks: int = 0
    lora_adapters: frozenset[str] = frozenset()
    data_parallel_rank: int | None = None
    role: str = ""  # "prefill", "decode", or "" for both (kvroute/roles.py)


class ControlPlaneClient:
    def __init__(
        self,
        address: str,
        query_timeout_s: float = 0.005,
        refresh_interval_s: float = 0.5,
        static_workers: dict[str, str] | None = None,
        static_block_size: int = 16,
        router_id: str | None = None,
        use_session: bool = True,
        query_deadline: QueryDeadline | None = None,
        tls: ClientTls | None = None,
        max_message_bytes: int = 64 * 1024 * 1024,
        view: FleetView | None = None,
        discovery: EngineDiscovery | None = None,
        unreported_model: str = "",
        static_models: Mapping[str, str] | None = None,
        only_models: frozenset[str] = frozenset(),
    ) -> None:
        """`query_deadline`: an adaptive deadline (`query_deadline.py`); without one the deadline is
        `query_timeout_s`, fixed. `tls`: TLS to the control plane (kvroute/tls.py); when its files
        change, channels are opened anew and the old ones closed after `RETIRE_GRACE_S`. `view`: follow
        the fleet into it (`fleet_view.py`, `--index local`): the known fleet and the index's answers
        come from it, ListWorkers and queries are not used. `discovery`: engines found by DNS join
        the known fleet (started and closed by its owner). `unreported_model`: the model the workers
        no agent reports on (static, found by DNS) serve ("": whichever model is asked for);
        `static_models`: static worker id -> the model it serves, when not that one. `only_models`:
        the known fleet holds only these models' workers (empty: every model's; a view filters its own)."""
        self.unreported_model = unreported_model
        self.only_models = only_models
        self.tls = tls
        self._tls_generation = tls.generation if tls is not None else 0
        self._retiring: set[asyncio.Task] = set()
        # gRPC backs off reconnecting a channel up to 120 s by default: after a long outage a returning
        # control plane would wait that long for its routers. Retrying at least every second costs one
        # refused connect.
        self._grpc_options = [
            *grpc_message_options(max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        self.addresses = AddressRotation(address)
        self.address = self.addresses.next()[0]  # the replica in use
        self.query_deadline = query_deadline or QueryDeadline.fixed(query_timeout_s)
        self.refresh_interval_s = refresh_interval_s
        self._problems = RateLimitedLog(log, period_s=60.0)  # refresh failures: a line a minute at most
        self._channels: dict[str, tuple[grpc.aio.Channel, pb_grpc.ControlPlaneStub]] = {}
        self.failovers = 0  # moves to another replica
        self._down_until: dict[str, float] = {}  # replicas that failed lately: skipped by a failover until then
        self._session_address = ""
        self._session_losses = 0  # in a row, since the last session that opened
        self._sessions_seen = 0
        self.session = (
            RouterSessionLink(self._session_stub, router_id, on_lost=self._session_lost, tls=tls) if use_session else None
        )
        self.view = view
        if view is not None and self.session is not None:
            # Its own reservations are known exactly (RouterInflight): the view leaves them out.
            view.router_id, view.knows_own = self.session.router_id, True
        if self.session is not None:  # answers past the deadline still tell how slow the host is
            self.session.on_late_answer = self.query_deadline.observe
        self.fleet: dict[str, KnownWorker] = {}
        self.fleet_updated_at = 0.0  # monotonic time of the last successful ListWorkers; 0 = never
        self.reachable = False  # did the last ListWorkers succeed
        self.last_error = ""  # why the last ListWorkers failed ("" after a success)
        self._last_known: dict[str, list[KnownWorker]] = {}  # model -> last non-empty snapshot
        self._static = [
            KnownWorker(wid, "", url.rstrip("/"), static_block_size, pb.WorkerLoad())
            for wid, url in (static_workers or {}).items()
        ]
        # model -> its static workers ("": those of the default model, or of any without one)
        self._static_by_model: dict[str, list[KnownWorker]] = {}
        for worker in self._static:
            self._static_by_model.setdefault((static_models or {}).get(worker.worker_id, ""), []).append(worker)
        self._task: asyncio.Task | None = None
        self._tls_task: asyncio.Task | None = None
        self.discovery = discovery
        self._block_size_unreported = static_block_size
        self._found: tuple[int, list[tuple[str, KnownWorker]]] = (-1, [])  # (discovery version, its engines)
        self._taken: tuple[object, bool, frozenset[str]] = (None, False, frozenset())  # (roster, static, endpoints)
        self._merged: dict[tuple[str, str], tuple[list[KnownWorker], int, list[KnownWorker]]] = {}
        self._already_known: frozenset[str] = frozenset()  # engines found by DNS that are another worker
        self._models: tuple[object, frozenset[str]] = (None, frozenset())  # (fleet, the models registered in it)

    # ------------------------------------------------------------ lifecycle

    @property
    def _stub(self) -> pb_grpc.ControlPlaneStub:
        return self.stub_for(self.address)

    def stub_for(self, address: str) -> pb_grpc.ControlPlaneStub:
        if self.tls is not None and self.tls.generation != self._tls_generation:
            self._retire_channels()
        entry = self._channels.get(address)
        if entry is None:
            channel = open_channel(address, self.tls, self._grpc_options)
            entry = self._channels[address] = (channel, pb_grpc.ControlPlaneStub(channel))
        return entry[1]

    def _retire_channels(self) -> None:
        """The certificate files changed: new channels from now on; calls on the old ones (the router
        session) get `RETIRE_GRACE_S` to finish."""
        self._tls_generation = self.tls.generation if self.tls is not None else 0
        old, self._channels = self._channels, {}
        for channel, _ in old.values():
            task = asyncio.ensure_future(channel.close(grace=RETIRE_GRACE_S))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        log.info("control-plane TLS certificates changed: new channels")

    def _failover(self, failed: str) -> bool:
        """`failed` did not answer: use the next replica (if `failed` is still the one in use and there
        is another), skipping replicas that failed in the last `DOWN_S` unless every one did. True
        when the client now uses another address than `failed`."""
        if not self.addresses.several:
            return False
        now = time.monotonic()
        self._down_until[failed] = now + DOWN_S
        if self.address == failed:
            candidates = self.addresses.round_addresses()
            count = len(candidates)
            picked = None
            for _ in range(2 * count):  # two rounds at most: the rotation may start a new one meanwhile
                nxt = self.addresses.next()[0]
                if nxt != failed and self._down_until.get(nxt, 0.0) <= now:
                    picked = nxt
                    break
                if picked is None and nxt != failed:
                    picked = nxt  # every other one failed lately: still better than the one that just did
            if picked is None:
                return False
            self.address = picked
            self.failovers += 1
            log.warning("control plane %s failed: using %s", failed, picked)
        return self.address != failed

    def _session_stub(self) -> pb_grpc.ControlPlaneStub:
        self._session_address = self.address
        return self._stub

    def _session_lost(self) -> bool:
        """The router session failed: move on; reconnect at once unless every replica failed in a row."""
        if self.session is not None and self.session.sessions != self._sessions_seen:
            self._sessions_seen, self._session_losses = self.session.sessions, 0
        self._session_losses += 1
        moved = self._failover(self._session_address)
        return moved and self._session_losses < len(self.addresses.round_addresses())

    def start(self) -> None:
        """Start the background refresher (first refresh immediately); open a channel to every replica
        now, so a failover does not wait for a TCP and HTTP/2 handshake."""
        if self.addresses.several:
            for address in self.addresses.round_addresses():
                self.stub_for(address)
                channel = self._channels[address][0]
                channel.get_state(try_to_connect=True)
        if self._task is None:
            self._task = (
                asyncio.create_task(FleetFollower(self.view, self).run(), name="kvroute-cp-follow")
                if self.view is not None
                else asyncio.create_task(self._refresh_forever(), name="kvroute-cp-refresh")
            )
        if self.view is not None and self.tls is not None and self._tls_task is None:
            self._tls_task = asyncio.create_task(self._watch_tls_forever(), name="kvroute-cp-tls")
        if self.session is not None:
            self.session.start()

    async def _watch_tls_forever(self, period_s: float = 1.0) -> None:
        """With a view nothing opens channels while the follow stream lasts: look at the certificate
        files anyway, so a rotated certificate is used (and a bad one reported) within seconds."""
        while True:
            await asyncio.sleep(period_s)
            if self.tls is not None and self.tls.generation != self._tls_generation:
                self._retire_channels()

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        await cancel_and_wait(self._task)
        await cancel_and_wait(self._tls_task)
        self._task = self._tls_task = None
        for channel, _ in self._channels.values():
            await channel.close()
        await cancel_and_wait(*self._retiring)

    # ------------------------------------------------------------ the known fleet

    @property
    def ever_reached(self) -> bool:
        return self.fleet_updated_at > 0

    @property
    def static_workers(self) -> list[KnownWorker]:
        """The --static-workers fleet, given or not in use (it is used only until the control plane is first reached)."""
        return list(self._static)

    def heard_from_control_plane(self) -> None:
        """The follow stream delivered a message (the view's link is up)."""
        self.fleet_updated_at = time.monotonic()
        if not self.reachable:
            self.reachable, self.last_error = True, ""
            log.info("following control plane %s", self.address)

    def lost_control_plane(self, address: str, reason: str) -> None:
        """The follow stream to `address` failed: the next attempt goes to the next replica."""
        self.reachable, self.last_error = False, reason
        self._failover(address)

    def workers_for(self, model: str, lora_name: str = "") -> list[KnownWorker]:
        """Known workers of `model` (and, if given, serving the LoRA adapter `lora_name`)."""
        if self.view is not None and self.view.synced:
            known = self.view.workers_for(model, lora_name)
        else:
            known = self._workers_for(model)
            if lora_name:
                known = [w for w in known if lora_name in w.lora_adapters or not w.model]
        if self.discovery is not None and self._serves_unreported(model):
            return self._with_found(model, lora_name, known)
        return known

    def _serves_unreported(self, model: str) -> bool:
        """Whether the workers no agent reports on serve `model`."""
        return not self.unreported_model or model == self.unreported_model

    def adapters_of(self, model: str) -> set[str]:
        """LoRA adapters some known worker of `model` serves (requests name them as `model`)."""
        return {a for w in self._workers_for(model) for a in w.lora_adapters}

    def _workers_for(self, model: str) -> list[KnownWorker]:
        return self._fleet_of(model)[1]

    def fleet_source(self, model: str) -> str:
        """Where `workers_for(model)` comes from: "view" (this router's view of the fleet, `--index local`),
        "control_plane" (the latest ListWorkers), "last_known" (the last non-empty one), "static"
        (--static-workers), "discovered" (engines found by DNS alone) or "none"."""
        source = self._fleet_of(model)[0]
        if source == "none" and self.discovery is not None and self.discovery.engines() and self._serves_unreported(model):
            return "discovered"
        return source

    def _fleet_of(self, model: str) -> tuple[str, list[KnownWorker]]:
        if self.view is not None and self.view.synced:
            return self.view.fleet_source(model), self.view.workers_for(model)
        current = [w for w in self.fleet.values() if w.model == model]
        if current:
            return "control_plane", current
        if model in self._last_known:
            return "last_known", list(self._last_known[model])
        if not self.ever_reached and self._static:  # control plane never reached: static fallback fleet
            static = self._static_by_model.get(model, [])
            if self._serves_unreported(model):
                static = static + self._static_by_model.get("", [])
            if static:
                return "static", static
        return "none", []

    # ------------------------------------------------------------ engines found by DNS

    def _with_found(self, model: str, lora_name: str, known: list[KnownWorker]) -> list[KnownWorker]:
        """`known` and, after it, the engines found by DNS that are no known worker already (the same
        HOST:PORT as one an agent reports on, of any model, or a static one in use). Read on every
        decision: with a view, the list is rebuilt only when the roster or the engines found change."""
        assert self.discovery is not None
        version = self.discovery.version
        cached = self._merged.get((model, lora_name))
        if cached is not None and cached[0] is known and cached[1] == version:
            return cached[2]
        found = self._found_workers()
        merged = known
        if found:
            taken = self._taken_endpoints()
            extra = [w for key, w in found if key not in taken]
            merged = known + extra if extra else known
            if not lora_name:
                self._log_already_known({w.worker_id for key, w in found if key in taken})
        if len(self._merged) > 64:  # adapters requested over time; a handful stay in use
            self._merged.clear()
        self._merged[(model, lora_name)] = (known, version, merged)
        return merged

    def _found_workers(self) -> list[tuple[str, KnownWorker]]:
        """(HOST:PORT, worker) of each engine found by DNS."""
        assert self.discovery is not None
        version = self.discovery.version
        if self._found[0] != version:
            self._found = (
                version,
                [
                    (_host_port(url), KnownWorker(wid, "", url, self._block_size_unreported, pb.WorkerLoad()))
                    for wid, url in self.discovery.engines().items()
                ],
            )
        return self._found[1]

    def _taken_endpoints(self) -> frozenset[str]:
        """HOST:PORT of every known worker of any model that is not an engine found by DNS: the agents'
        (an engine found there is that worker, or another model's engine), and the static ones in use.
        Re-read when the roster it comes from is replaced."""
        view = self.view
        if view is not None and view.synced:
            assert view.state is not None
            workers = view.state.registry.workers()  # one tuple per roster: its identity says when to re-read
            roster, static = workers, False
            endpoints: Iterable[str] = [r.endpoint for r in workers]
        else:
            roster, static = self.fleet, not self.ever_reached  # self.fleet: replaced by every ListWorkers
            endpoints = (
                [w.endpoint for w in self.fleet.values()]
                + [w.endpoint for known in self._last_known.values() for w in known]
                + ([w.endpoint for w in self._static] if static else [])
            )
        if self._taken[0] is not roster or self._taken[1] != static:
            self._taken = (roster, static, frozenset(map(_host_port, endpoints)))
        return self._taken[2]

    def _log_already_known(self, ids: set[str]) -> None:
        if ids != self._already_known:
            if ids - self._already_known:
                log.info(
                    "found by DNS and known already as another worker (an agent reports on it, routed as that worker): %s",
                    ", ".join(sorted(ids - self._already_known)),
                )
            if self._already_known - ids:
                log.info("found by DNS, no longer known as another worker: %s", ", ".join(sorted(self._already_known - ids)))
            self._already_known = frozenset(ids)

    def models(self) -> frozenset[str]:
        """Models with known workers: those agents registered (now or before), and `unreported_model`
        while a worker no agent reports on is known (without one, those serve any model, so add none).
        Read on every request: rebuilt only when the fleet it comes from changes."""
        if self.view is not None and self.view.synced:
            registered = self.view.models_served()
        else:
            registered = self._registered_models()
        unreported = self.unreported_model
        if unreported and unreported not in registered and self.workers_for(unreported):
            registered = registered | {unreported}
        if not self.ever_reached and len(self._static_by_model) > ("" in self._static_by_model):
            registered = registered | (self._static_by_model.keys() - {""})  # static workers that name their model
        return registered

    def _registered_models(self) -> frozenset[str]:
        fleet = self.fleet  # replaced by every ListWorkers: its identity says when to re-read
        if self._models[0] is not fleet:
            self._models = (fleet, frozenset(w.model for w in fleet.values()) | frozenset(self._last_known))
        return self._models[1]

    async def refresh(self) -> None:
        address = self.address
        try:
            response = await self.stub_for(address).ListWorkers(
                pb.ListWorkersRequest(), timeout=max(1.0, self.refresh_interval_s)
            )
        except grpc.aio.AioRpcError:
            self._failover(address)
            raise
        fleet = {
            w.worker_id: KnownWorker(
                w.worker_id,
                w.model,
                w.endpoint.rstrip("/"),
                w.block_size,
                w.load,
                w.cached_blocks,
                frozenset(w.lora_adapters),
                w.data_parallel_rank if w.HasField("data_parallel_rank") else None,
                w.role,
            )
            for w in response.workers
            if not self.only_models or w.model in self.only_models
        }
        joined, left = fleet.keys() - self.fleet.keys(), self.fleet.keys() - fleet.keys()
        if joined or left:
            log.info(
                "fleet: %d workers (joined: %s; left: %s)",
                len(fleet),
                ", ".join(sorted(joined)) or "-",
                ", ".join(sorted(left)) or "-",
            )
        self.fleet = fleet
        for model in {w.model for w in fleet.values()}:
            self._last_known[model] = [w for w in fleet.values() if w.model == model]
        self.fleet_updated_at = time.monotonic()
        self.reachable, self.last_error = True, ""

    async def _refresh_forever(self) -> None:
        failures = 0
        while True:
            try:
                await self.refresh()
                self._problems.recovered(
                    "unreachable", "control plane %s reachable again after %d failed refreshes", self.address, failures
                )
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the refresher must never die
                self.reachable = False
                failures += 1
                reason = rpc_failure_reason(exc, self.tls)
                self.last_error = reason
                self._problems.warning(
                    "unreachable",
                    "control plane %s unreachable (%s, %d times); routing on the last known fleet (%d workers)",
                    self.address,
                    reason,
                    failures,
                    len(self.fleet) or len(self._static),
                )
            await asyncio.sleep(self.refresh_interval_s)

    # ------------------------------------------------------------ the index

    async def query(self, model: str, chains: dict[int, list[int]], lora_name: str = "") -> pb.WorkerColumns:
        """Matched prefix, tiers, load and other routers' reservations of every live worker of
        `model` (serving `lora_name` if given), as columns; `chains` maps block size -> keys.

        Raises TimeoutError past the deadline (`query_deadline.seconds`) on the session,
        grpc.aio.AioRpcError on the unary path (DEADLINE_EXCEEDED, UNAVAILABLE...)."""
        message = query_message(model, chains, lora_name)
        deadline = self.query_deadline
        timeout_s = deadline.seconds
        started = time.perf_counter()
        if self.session is not None and self.session.connected:
            try:
                columns = (await self.session.query(message, timeout_s)).columns
                deadline.observe(time.perf_counter() - started)
                return columns
            except SessionUnavailable:
                pass  # lost just now: the unary call below still has a chance
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + timeout_s
        tried: set[str] = set()
        while True:  # the next replicas, within what is left of the deadline
            address = self.address
            tried.add(address)
            try:
                response = await self.stub_for(address).Query(message.query, timeout=max(1e-4, give_up_at - loop.time()))
                deadline.observe(time.perf_counter() - started)
                return response.columns
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise  # a slow answer (DEADLINE_EXCEEDED) is a busy replica, not a gone one: stay
                if not self._failover(address) or self.address in tried or loop.time() >= give_up_at:
                    raise


def _host_port(endpoint: str) -> str:
    """An endpoint URL's HOST:PORT, lower-cased (the port as written: agents and DNS both name it)."""
    return endpoint.partition("://")[2].partition("/")[0].rpartition("@")[2].lower()


def query_message(model: str, chains: dict[int, list[int]], lora_name: str = "") -> pb.RouterMessage:
    """The router-session message of a columnar query (its `query_id` is the session's to set)."""
    # Filled in place inside the stream message: a message passed to a constructor is copied,
    # and this one carries every block key of the prompt.
    message = pb.RouterMessage()
    request = message.query
    request.model, request.lora_name, request.columnar = model, lora_name, True
    for bs, keys in chains.items():
        request.chains.add(block_size=bs, block_keys=keys)
    return message
