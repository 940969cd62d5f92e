"""Reading a msgpack batch's structure without building it.

msgspec decodes (and skips) nested values recursively, up to Python's recursion limit, and has no
call that says where one value ends. The decoders need both for input no engine sends: how many
events a batch claims before anything is allocated for them (`claimed_events`), and where each
event of a batch ends when one of them is nested past that limit, so its neighbours still decode
(`split_batch`). `skip` walks the msgpack grammar iteratively, one step per value: it never
recurses, and a length header it has not verified against the input costs nothing.
"""

from __future__ import annotations

import msgspec


class ScanError(ValueError):
    """The bytes are not one complete msgpack value where one was expected."""


# Fixed-size values by first byte: the number of bytes the whole value takes.
_FIXED = {
    0xC0: 1,
    0xC2: 1,
    0xC3: 1,
    0xCA: 5,
    0xCB: 9,
    0xCC: 2,
    0xCD: 3,
    0xCE: 5,
    0xCF: 9,
    0xD0: 2,
    0xD1: 3,
    0xD2: 5,
    0xD3: 9,
    0xD4: 3,
    0xD5: 4,
    0xD6: 6,
    0xD7: 10,
    0xD8: 18,
}
# Values with a length prefix: first byte -> (bytes of the length field, bytes before the data besides it).
_SIZED = {
    0xC4: (1, 0),
    0xC5: (2, 0),
    0xC6: (4, 0),
    0xD9: (1, 0),
    0xDA: (2, 0),
    0xDB: (4, 0),
    0xC7: (1, 1),
    0xC8: (2, 1),
    0xC9: (4, 1),
}  # bin8/16/32, str8/16/32, ext8/16/32 (+ the type byte)
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}  # array16/32, map16/32: (length bytes, items per entry)


def _uint(buf: bytes, pos: int, size: int) -> int:
    if pos + size > len(buf):
        raise ScanError("truncated")
    return int.from_bytes(buf[pos : pos + size], "big")


def container(buf: bytes, pos: int) -> tuple[str, int, int] | None:
    """("array" | "map", number of elements or entries, position after the header) of the value at
    `pos`, or None when it is not a container."""
    if pos >= len(buf):
        raise ScanError("truncated")
    b = buf[pos]
    if 0x90 <= b <= 0x9F:
        return "array", b & 0x0F, pos + 1
    if 0x80 <= b <= 0x8F:
        return "map", b & 0x0F, pos + 1
    if b in _CONTAINERS:
        size, _ = _CONTAINERS[b]
        return ("array" if b in (0xDC, 0xDD) else "map"), _uint(buf, pos + 1, size), pos + 1 + size
    return None


def skip(buf: bytes, pos: int) -> int:
    """The position just after the msgpack value that starts at `pos`. Raises ScanError."""
    n = len(buf)
    pending = 1  # values still to skip: containers add their elements, so no recursion is needed
    while pending:
        if pos >= n:
            raise ScanError("truncated")
        b = buf[pos]
        pending -= 1
        if b <= 0x7F or b >= 0xE0:  # positive / negative fixint
            pos += 1
        elif b <= 0x8F:
            pending += 2 * (b & 0x0F)
            pos += 1
        elif b <= 0x9F:
            pending += b & 0x0F
            pos += 1
        elif b <= 0xBF:
            pos += 1 + (b & 0x1F)
        elif b in _FIXED:
            pos += _FIXED[b]
        elif b in _SIZED:
            size, extra = _SIZED[b]
            pos += 1 + size + extra + _uint(buf, pos + 1, size)
        elif b in _CONTAINERS:
            size, per_entry = _CONTAINERS[b]
            pending += per_entry * _uint(buf, pos + 1, size)
            pos += 1 + size
        else:  # 0xC1: never used
            raise ScanError(f"invalid msgpack byte 0x{b:02x}")
    if pos > n:
        raise ScanError("truncated")
    return pos


_NUMBER_SIZES = {
    **{b: 1 for b in range(0x80)},
    **{b: 1 for b in range(0xE0, 0x100)},
    **{b: _FIXED[b] for b in (0xCA, 0xCB, 0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD1, 0xD2, 0xD3)},
}


class _MapEvents(msgspec.Struct):
    """A map batch's `events`, left unread (msgspec skips the other keys in C)."""

    events: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"\x90"))


_dec_map_events = msgspec.msgpack.Decoder(_MapEvents)


def claimed_events(payload: bytes) -> int | None:
    """How many events a batch `[ts, events, ...]` or `{"events": [...], ...}` says it holds, read from the
    headers alone, in constant time for an array batch (None: not that shape, or not readable; the
    decoder then reports why). A `ts` that is not a number is not stepped over: no batch has one."""
    try:
        head = container(payload, 0)
        if head is None:
            return None
        kind, entries, pos = head
        if kind == "map":
            events = container(memoryview(_dec_map_events.decode(payload).events), 0)
        elif entries < 2 or pos >= len(payload) or payload[pos] not in _NUMBER_SIZES:
            return None
        else:
            events = container(payload, pos + _NUMBER_SIZES[payload[pos]])
    except (ScanError, msgspec.MsgspecError, RecursionError):
        return None
    return events[1] if events and events[0] == "array" else None


def split_batch(payload: bytes) -> tuple[bytes, list[bytes], bytes | None]:
    """(ts, each event, rank) of a batch as msgpack slices, for a batch msgspec cannot take apart
    (nested past its recursion limit). An array batch `[ts, events(, rank)]`, or a map batch with
    keys `ts`, `events` and `data_parallel_rank`. Raises ScanError."""
    head = container(payload, 0)
    if head is None:
        raise ScanError("a batch is an array or a map")
    kind, entries, pos = head
    fields: dict[str, tuple[int, int]] = {}
    names = ("ts", "events", "data_parallel_rank")
    for i in range(entries):
        if kind == "map":
            end = skip(payload, pos)
            try:
                name = msgspec.msgpack.decode(payload[pos:end])
            except (msgspec.MsgspecError, RecursionError):
                name = None
            pos = end
        else:
            name = names[i] if i < len(names) else None
        end = skip(payload, pos)
        if isinstance(name, str) and name in names:
            fields[name] = (pos, end)
        pos = end
    if pos != len(payload):
        raise ScanError("trailing bytes after the batch")
    if "ts" not in fields or "events" not in fields:
        raise ScanError("a batch needs ts and events")
    start, end = fields["events"]
    events = container(payload, start)
    if events is None or events[0] != "array":
        raise ScanError("events is not an array")
    out, pos = [], events[2]
    for _ in range(events[1]):
        stop = skip(payload, pos)
        out.append(payload[pos:stop])
        pos = stop
    ts = payload[slice(*fields["ts"])]
    rank = payload[slice(*fields["data_parallel_rank"])] if "data_parallel_rank" in fields else None
    return ts, out, rank
