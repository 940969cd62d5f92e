"""The log's entry bodies (kvroute.fleet.entries) as Redis holds them: fields added last decode from
entries written before them."""

from __future__ import annotations

import msgspec

from kvroute.fleet.entries import ENCODER, HEARTBEAT_DECODER, HeartbeatBody


def test_a_heartbeat_written_before_kv_capacity_decodes_with_capacity_unknown() -> None:
    older = msgspec.msgpack.encode([3, 1, 0.5, 1_700_000_000_000, ["ad"]])  # the five fields it had
    assert HEARTBEAT_DECODER.decode(older) == HeartbeatBody(3, 1, 0.5, 1_700_000_000_000, ["ad"], 0)
    newer = HeartbeatBody(3, 1, 0.5, 1, [], 16_384)
    assert HEARTBEAT_DECODER.decode(ENCODER.encode(newer)) == newer
