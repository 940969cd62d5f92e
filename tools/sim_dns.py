"""A DNS server standing in for a cluster's (CoreDNS in Kubernetes), for the tests and docs/operations.md's
DNS discovery example: `kvroute sim-dns --records records.txt --port 5353`.

    server = SimDns().start()     # UDP on 127.0.0.1, on a port of its own: server.port
    server.set("_http._tcp.engines.kvroute.test", "SRV", ["0 0 8001 localhost."])
    server.set("localhost", "A", ["127.0.0.1"])
    server.failing = "servfail"   # every answer SERVFAIL; "drop": no answer at all; None: answer again
    server.stop()

Contract: UDP, class IN. A name with records of the asked type gets them (TTL 5 s, CoreDNS's
default for a cluster's names); a name with records of other types only, an empty NOERROR answer;
any other name NXDOMAIN. Names are absolute: with a trailing dot or without, the same name. An
answer too long for the asker's UDP size is sent truncated (TC), with no TCP to retry on: keep
records few. `--records FILE` holds one record a line, `NAME TYPE RDATA` as in a zone file (`#`
starts a comment), and is read again whenever it changes, so engines join and leave by editing it.
`queries` counts the questions answered (or dropped).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import threading
from pathlib import Path

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdata
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from kvroute.addresses import listen_host, port

log = logging.getLogger("kvroute.sim_dns")
TTL_S = 5
Records = dict[tuple[dns.name.Name, dns.rdatatype.RdataType], list[dns.rdata.Rdata]]


def _name(text: str) -> dns.name.Name:
    return dns.name.from_text(text, origin=dns.name.root)


def parse_records(text: str) -> Records:
    """`NAME TYPE RDATA` lines (zone-file RDATA, names relative to the root) -> records; ValueError naming the line."""
    records: Records = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            name, rdtype, rdata = line.split(None, 2)
            kind = dns.rdatatype.from_text(rdtype)
            value = dns.rdata.from_text(dns.rdataclass.IN, kind, rdata, origin=dns.name.root, relativize=False)
            records.setdefault((_name(name), kind), []).append(value)
        except (ValueError, dns.exception.DNSException) as exc:
            raise ValueError(f"line {number}: {line!r} is not NAME TYPE RDATA ({exc})") from None
    return records


class SimDns:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, records_file: Path | None = None) -> None:
        self.host, self.port = host, port
        self.records_file = records_file
        self.failing: str | None = None  # "servfail", "drop" or None
        self.queries = 0
        self._records: Records = {}
        self._lock = threading.Lock()
        self._file_stamp: tuple[int, int] | None = None
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ records

    def set(self, name: str, rdtype: str, values: list[str]) -> None:
        """Replace `name`'s records of `rdtype` (none: remove them)."""
        kind = dns.rdatatype.from_text(rdtype)
        parsed = [dns.rdata.from_text(dns.rdataclass.IN, kind, v, origin=dns.name.root, relativize=False) for v in values]
        with self._lock:
            if parsed:
                self._records[(_name(name), kind)] = parsed
            else:
                self._records.pop((_name(name), kind), None)

    def clear(self) -> None:
        with self._lock:
            self._records.clear()

    def _reload(self) -> None:
        """Read --records again if it changed; a file that does not parse keeps the records (logged)."""
        if self.records_file is None:
            return
        try:
            stat = self.records_file.stat()
            stamp = (stat.st_mtime_ns, stat.st_size)
            if stamp == self._file_stamp:
                return
            self._file_stamp = stamp
            records = parse_records(self.records_file.read_text())
        except (OSError, ValueError) as exc:
            log.warning("%s: %s; keeping the records read before", self.records_file, exc)
            return
        with self._lock:
            self._records = records
        log.info("%s: %d names", self.records_file, len({name for name, _ in records}))

    # ------------------------------------------------------------ answering

    def answer(self, wire: bytes) -> bytes | None:
        """The answer to one query's bytes (None: send nothing)."""
        try:
            query = dns.message.from_wire(wire)
        except dns.exception.DNSException:
            return None
        self.queries += 1
        if self.failing == "drop" or not query.question:
            return None
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        if self.failing == "servfail":
            response.set_rcode(dns.rcode.SERVFAIL)
            return response.to_wire()
        question = query.question[0]
        with self._lock:
            found = self._records.get((question.name, question.rdtype))
            known = found is not None or any(name == question.name for name, _ in self._records)
        if found:
            response.answer.append(dns.rrset.from_rdata_list(question.name, TTL_S, found))
        elif not known:
            response.set_rcode(dns.rcode.NXDOMAIN)
        try:
            return response.to_wire(max_size=query.payload if query.edns >= 0 else 512)
        except dns.exception.TooBig:
            response.answer.clear()
            response.flags |= dns.flags.TC
            return response.to_wire()

    # ------------------------------------------------------------ serving

    def start(self) -> SimDns:
        """Bind (OSError when the port is taken) and answer from a thread of its own."""
        self._reload()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        sock.settimeout(0.2)  # how soon stop() and a changed --records file are noticed
        self._sock, self.port = sock, sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="kvroute-sim-dns", daemon=True)
        self._thread.start()
        return self

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            self._reload()
            try:
                wire, peer = self._sock.recvfrom(65535)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                reply = self.answer(wire)
            except Exception:  # one bad record or query must not end the server
                log.exception("cannot answer %s", peer)
                continue
            if reply is not None:
                try:
                    self._sock.sendto(reply, peer)
                except OSError as exc:
                    log.warning("cannot answer %s: %s", peer, exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._sock is not None:
            self._sock.close()


# ---------------------------------------------------------------- kvroute sim-dns


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvroute.process import add_log_level_argument, add_port_file_argument

    p.add_argument("--host", type=listen_host, default="127.0.0.1", help="UDP listen address")
    p.add_argument("--port", type=port, default=5353, help="UDP port (0 = any free port)")
    p.add_argument(
        "--records",
        type=Path,
        required=True,
        metavar="FILE",
        help="the records, `NAME TYPE RDATA` a line (e.g. `engines.test A 127.0.0.1`, "
        "`_http._tcp.engines.test SRV 0 0 8001 localhost.`); read again when it changes",
    )
    add_log_level_argument(p)
    add_port_file_argument(p)


async def serve(args: argparse.Namespace) -> int:
    from kvroute.listeners import ListenError, check_port, describe_os_error
    from kvroute.process import wait_for_stop_signal, write_port_file

    address = check_port("--port", args.host, args.port)
    try:
        records = parse_records(args.records.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"kvroute sim-dns: error: --records {args.records}: {exc}") from None
    server = SimDns(args.host, args.port, args.records)
    try:
        server.start()
    except OSError as exc:
        raise ListenError("--port", str(address), describe_os_error(exc)) from None
    log.info(
        "sim-dns answering on %s:%d (udp) from %s: %d names",
        args.host,
        server.port,
        args.records,
        len({name for name, _ in records}),
    )
    write_port_file(args.port_file, {"dns": server.port})
    try:
        await wait_for_stop_signal()
    finally:
        await asyncio.to_thread(server.stop)
    return 0


def run(args: argparse.Namespace) -> int:
    from kvroute.listeners import run_service
    from kvroute.process import process_setup

    with process_setup("kvroute-sim-dns", args.log_level):
        return run_service("sim-dns", serve(args))
