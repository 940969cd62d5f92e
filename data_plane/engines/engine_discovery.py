"""Engines found by DNS: engines that run without an agent join and leave the router's fleet as a
DNS name's answer changes (a Kubernetes headless Service: one address per ready pod).

    targets = [parse_target("dns://vllm-headless.llm.svc.cluster.local:8000"),
               parse_target("dnssrv://_http._tcp.vllm-headless.llm.svc.cluster.local")]
    discovery = EngineDiscovery(targets, make_resolver(dns_server=""), interval_s=5.0, empty_grace_s=30.0)
    discovery.start()
    discovery.engines()   # {"10.1.2.3:8000": "http://10.1.2.3:8000", ...}: worker id -> endpoint
    await discovery.close()

Contract:
- `dns://NAME:PORT`: NAME's A records (its AAAA records when it has no A record), each address an
  engine at PORT. `dnssrv://NAME`: NAME's SRV records (a headless Service publishes
  `_PORTNAME._tcp.SERVICE.NAMESPACE.svc.cluster.local` per named port), each target's addresses at
  the record's port. An engine is `http://ADDRESS:PORT` with the worker id `ADDRESS:PORT`
  (`[ADDRESS]:PORT` for IPv6): readable, stable while the pod keeps its IP, and the endpoint an
  agent in that pod registers (`http://$(POD_IP):8000`), which is how the control-plane client
  makes an engine found here and reported by an agent one worker.
- Names go to the nameservers of /etc/resolv.conf, with its search list and ndots (a short name
  works in a pod as it does for any program there), or to `dns_server` alone; /etc/hosts is not
  read. Every target is resolved at `start()` and then every `interval_s` after the last round ended.
- An answer replaces the target's engines; every change is logged (one line: who joined, who
  left). A resolution that fails (timeout, SERVFAIL, refused, ...) keeps the target's engines,
  counts `failures` and is logged at most once a minute, and once when the name resolves again.
  An empty answer (NXDOMAIN, or no record of the type) after engines were found empties the target
  only once the answers have stayed empty for `empty_grace_s`: a DNS server that restarts with
  nothing must not empty the fleet, while an engine really gone is taken out by the router's
  health checks meanwhile.
- `version` moves whenever `engines()` changes, so what is built from it can be cached.
"""

from __future__ import annotations

import asyncio
import logging
import time
from argparse import ArgumentTypeError
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import dns.asyncresolver
import dns.exception
import dns.name
import dns.resolver

from kvroute import addresses
from kvroute.aio import cancel_and_wait
from kvroute.rate_limited_log import RateLimitedLog

log = logging.getLogger("kvroute.router.discovery")

SCHEMES = ("dns://NAME:PORT", "dnssrv://NAME")
QUERY_TIMEOUT_S = 5.0  # one name's resolution, all nameservers and retries included (dnspython's own default)


class DiscoveryError(ValueError):
    """A target or DNS server that cannot be used; str() is the one line to show."""


class ResolutionFailed(Exception):
    """The DNS did not answer the question (as opposed to answering that there is nothing)."""


@dataclass(frozen=True, slots=True)
class DiscoveryTarget:
    spec: str  # as given: the metric label and what log lines name
    name: str
    port: int  # dns://: every address's port; 0 for dnssrv:// (each record has its own)

    @property
    def srv(self) -> bool:
        return self.port == 0


def parse_target(spec: str) -> DiscoveryTarget:
    """`dns://NAME:PORT` or `dnssrv://NAME`; DiscoveryError saying what is wrong otherwise."""
    scheme, sep, rest = spec.strip().partition("://")
    if not sep or scheme not in ("dns", "dnssrv"):
        raise DiscoveryError(f"{spec!r} is neither {' nor '.join(SCHEMES)}")
    name, port = rest, 0
    if scheme == "dns":
        name, sep, port_text = rest.rpartition(":")
        if not sep or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise DiscoveryError(f"{spec!r}: dns:// needs the engines' port, as in dns://NAME:8000")
        port = int(port_text)
    elif ":" in rest:
        raise DiscoveryError(f"{spec!r}: dnssrv:// takes no port (each SRV record has its own)")
    if not name or "/" in name:
        raise DiscoveryError(f"{spec!r}: no DNS name")
    try:
        dns.name.from_text(name)
    except dns.exception.DNSException as exc:
        raise DiscoveryError(f"{spec!r}: {name!r} is not a DNS name ({exc})") from None
    return DiscoveryTarget(spec.strip(), name, port)


def parse_dns_server(value: str) -> tuple[str, int]:
    """`IP`, `IP:PORT` or `[IPv6]:PORT` -> (ip, port); port 53 unless given (`kvroute.addresses`)."""
    try:
        server = addresses.parse_dns_server(value)
    except ArgumentTypeError as exc:
        raise DiscoveryError(str(exc)) from None
    return server.host, server.port


def make_resolver(dns_server: str = "", timeout_s: float = QUERY_TIMEOUT_S) -> dns.asyncresolver.Resolver:
    """The resolver of /etc/resolv.conf, or one asking `dns_server` (IP[:PORT]) alone. No cache:
    every round asks again. DiscoveryError when neither is usable."""
    if dns_server:
        host, port = parse_dns_server(dns_server)
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers, resolver.port = [host], port
    else:
        try:
            resolver = dns.asyncresolver.Resolver()
        except dns.exception.DNSException as exc:
            raise DiscoveryError(
                f"cannot read the system's DNS configuration ({exc}); name a server with --dns-server IP[:PORT]"
            ) from None
    resolver.lifetime = timeout_s
    return resolver


def engine_id(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


@dataclass(slots=True)
class TargetState:
    engines: dict[str, str] = field(default_factory=dict)  # worker id -> endpoint, as last applied
    failures: int = 0  # resolutions that failed (the engines were kept)
    last_success_unix: float = 0.0  # wall time of the last answer, empty ones included (0 = none yet)
    empty_since: float | None = None  # monotonic time empty answers began while engines were kept


class EngineDiscovery:
    def __init__(
        self,
        targets: Sequence[DiscoveryTarget],
        resolver: dns.asyncresolver.Resolver,
        interval_s: float = 5.0,
        empty_grace_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.targets = list(targets)
        self.resolver = resolver
        self.interval_s, self.empty_grace_s = interval_s, empty_grace_s
        self.clock = clock
        self.states = {t.spec: TargetState() for t in self.targets}
        self.version = 0
        self.rounds = 0  # resolution rounds completed
        self._engines: dict[str, str] = {}
        self._problems = RateLimitedLog(log, period_s=60.0)
        self._task: asyncio.Task | None = None

    def engines(self) -> dict[str, str]:
        """Worker id -> endpoint of every engine found, over all targets, in a stable order."""
        return self._engines

    def describe(self) -> str:
        """What the targets found, for a router that knows no worker ("dns://a:8000 found none, ...")."""
        return ", ".join(f"{t.spec} found {len(self.states[t.spec].engines) or 'none'}" for t in self.targets)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvroute-engine-discovery")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            await self.resolve_once()
            await asyncio.sleep(self.interval_s)

    async def resolve_once(self) -> None:
        """One round: every target at once, each answer applied as the module docstring says."""
        results = await asyncio.gather(*(self._lookup(t) for t in self.targets), return_exceptions=True)
        changed = False
        for target, result in zip(self.targets, results):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, BaseException):
                self._failed(target, result)
            else:
                changed |= self._answered(target, result)
        if changed:
            merged: dict[str, str] = {}
            for target in self.targets:
                merged |= self.states[target.spec].engines
            self._engines = merged
            self.version += 1
        self.rounds += 1

    # ------------------------------------------------------------ applying answers

    def _answered(self, target: DiscoveryTarget, found: dict[str, str]) -> bool:
        """Apply an answer (`found` may be empty); True when the target's engines changed."""
        state = self.states[target.spec]
        state.last_success_unix = time.time()
        if self._problems.recovered(f"failed {target.spec}"):
            log.info("%s resolves again (%d engines)", target.spec, len(found))
        if not found and state.engines:
            now = self.clock()
            if state.empty_since is None:
                state.empty_since = now
                log.warning(
                    "%s answered no engine; keeping the %d found before for %gs (--discovery-empty-grace-s) "
                    "unless it answers again",
                    target.spec,
                    len(state.engines),
                    self.empty_grace_s,
                )
                return False
            if now - state.empty_since < self.empty_grace_s:
                return False
        if state.empty_since is not None and found:
            log.info("%s answers again", target.spec)
        state.empty_since = None
        if not found and not state.engines:
            self._problems.warning(f"empty {target.spec}", "%s answers no engine", target.spec)
            return False
        if found:
            self._problems.recovered(f"empty {target.spec}")
        joined, left = found.keys() - state.engines.keys(), state.engines.keys() - found.keys()
        if not joined and not left:
            return False
        log.info(
            "%s: %d engines (joined: %s; left: %s)",
            target.spec,
            len(found),
            ", ".join(sorted(joined)) or "-",
            ", ".join(sorted(left)) or "-",
        )
        state.engines = found
        return True

    def _failed(self, target: DiscoveryTarget, exc: BaseException) -> None:
        state = self.states[target.spec]
        state.failures += 1
        why = str(exc) if isinstance(exc, ResolutionFailed) else f"{type(exc).__name__}: {exc}"
        self._problems.warning(
            f"failed {target.spec}",
            "cannot resolve %s (%s; %d failed resolutions so far); keeping its %d engines",
            target.spec,
            why,
            state.failures,
            len(state.engines),
        )

    # ------------------------------------------------------------ asking the DNS

    async def _lookup(self, target: DiscoveryTarget) -> dict[str, str]:
        """The target's engines now ({} for an empty answer); ResolutionFailed when the DNS did not answer."""
        if not target.srv:
            addresses = await self._addresses(target.name, search=True)
            return {engine_id(a, target.port): f"http://{engine_id(a, target.port)}" for a in sorted(addresses)}
        # A target of "." says the service is not offered there (RFC 2782).
        records = sorted(
            {(r.target, r.port) for r in await self._query(target.name, "SRV", search=True) if r.target != dns.name.root}
        )
        resolved = await asyncio.gather(*(self._addresses(host, search=False) for host, _ in records))
        found = {}
        for (_, port), addresses in zip(records, resolved):
            for address in sorted(addresses):
                found[engine_id(address, port)] = f"http://{engine_id(address, port)}"
        return dict(sorted(found.items()))

    async def _addresses(self, name: str | dns.name.Name, search: bool) -> list[str]:
        """IPv4 addresses of `name`, else its IPv6 ones (as `--control-plane` names are resolved)."""
        v4 = await self._query(name, "A", search)
        return [r.address for r in v4] if v4 else [r.address for r in await self._query(name, "AAAA", search)]

    async def _query(self, name: str | dns.name.Name, rdtype: str, search: bool) -> list:
        try:
            answer = await self.resolver.resolve(name, rdtype, search=search)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        except dns.resolver.LifetimeTimeout:
            raise ResolutionFailed(f"{rdtype} {name}: no answer within {self.resolver.lifetime:g}s") from None
        except dns.resolver.NoNameservers as exc:  # SERVFAIL, REFUSED... from every server
            raise ResolutionFailed(f"{rdtype} {name}: {exc}") from None
        except (dns.exception.DNSException, OSError) as exc:
            raise ResolutionFailed(f"{rdtype} {name}: {type(exc).__name__}: {exc}") from None
        return list(answer)
