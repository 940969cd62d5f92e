"""Property-based tests of the TensorRT-LLM pull-path decoder (`POST /kv_cache_events` JSON,
docs/wire-formats.md#tensorrt-llm-pull-path-json).

(a) Agreement: steps of cache events drawn by hypothesis go through the sim engine's own event queue
(`sim_engine/trtllm_events.py`, sharing no code with the agent), are drained as the sim engine's HTTP
handler writes them (json.dumps) over one or several polls, and convert to the engine-neutral events
the pull path's field table says, with no reset (the event ids are consecutive).
(b) Hostility: arbitrary bytes, truncated or mutated bodies, wrong types in every field, numbers out
of every range, NaN, lone surrogates, invalid UTF-8, deep nesting: `feed` raises nothing but
`BodyError`, in bounded time and memory; a bad event is counted and its neighbours apply.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvroute.tools.sim_engine.prefix_cache import CPU, GPU, ClearedEvent, RemovedEvent, StoredEvent
from kvroute.tools.sim_engine.trtllm_events import TrtllmEventQueue
from kvroute.worker_agent.events import U64, BlockRemoved, BlockStored
from kvroute.worker_agent.trtllm_events import BodyError, OversizeBodyError, RankEvents, RankReset, TrtllmEventConverter
from tests.hostile import Bounded, namespaces, token_ids

WINDOW = 4096
HEX = st.binary(min_size=32, max_size=32).map(bytes.hex)
INTS = st.integers(0, U64)
HASHES = {True: (HEX, st.none() | HEX), False: (INTS, st.none() | INTS)}  # hex? -> (hash, hash or None)
STEP_KINDS = st.sampled_from(("stored", "stored", "removed", "moved", "cleared"))
RANKS = st.none() | st.integers(0, 7)
MUTATIONS = st.sampled_from(("truncate", "flip", "insert", "delete"))
bounded = Bounded()


def u64(h: int | str) -> int:
    return int(h[-16:], 16) if isinstance(h, str) else h & U64


@st.composite
def steps(draw, hex_hashes: bool, block_size: int):
    """Scheduler steps of cache events as the sim engine's cache records them (GPU stores, removals,
    offloads to and from the CPU tier, resets); each step is one `publish`."""
    hashes, parents = HASHES[hex_hashes]
    out = []
    for _ in range(draw(st.integers(0, 3))):
        step = []
        for _ in range(draw(st.integers(1, 3))):
            kind = draw(STEP_KINDS)
            if kind == "stored":
                n = draw(st.integers(1, 4))
                tokens = draw(token_ids(n * block_size))
                ns = draw(namespaces())
                step.append(StoredEvent(draw(st.lists(hashes, min_size=n, max_size=n)), draw(parents), tokens, GPU, ns))
            elif kind == "removed":
                step.append(RemovedEvent(draw(st.lists(hashes, min_size=1, max_size=4))))
            elif kind == "moved":  # offload: removed from the GPU tier, stored on the CPU tier (an `updated` each)
                moved = draw(st.lists(hashes, min_size=1, max_size=3))
                step += [RemovedEvent(moved, GPU, moved_to=CPU), StoredEvent(moved, None, [], CPU, moved_from=GPU)]
            else:
                step.append(ClearedEvent(draw(st.lists(hashes, max_size=4))))
        out.append(step)
    return out


def expected(ev, block_size: int) -> list:
    """What the pull path's field table makes of one cache event (docs/wire-formats.md#tensorrt-llm-pull-path-json)."""
    if isinstance(ev, StoredEvent):
        if ev.moved_from is not None:
            return []  # `updated` events: counted, ignored
        ns = ev.namespace
        return [
            BlockStored(
                [u64(h) for h in ev.block_hashes],
                None if ev.parent_block_hash is None else u64(ev.parent_block_hash),
                list(ev.token_ids),
                block_size,
                lora_id=ns.lora_id,
                cache_salt=ns.cache_salt or None,
            )
        ]
    if isinstance(ev, RemovedEvent):
        return [] if ev.moved_to is not None else [BlockRemoved([u64(h) for h in ev.block_hashes])]
    return [BlockRemoved([u64(h) for h in ev.block_hashes])] if ev.block_hashes else []


@st.composite
def engine_polls(draw):
    """(rank, block size, the steps, the response bodies of the polls that drained them)."""
    hex_hashes = draw(st.booleans())
    rank = draw(RANKS)
    block_size = draw(st.integers(1, 8))
    queue = TrtllmEventQueue(64, 16, WINDOW, hex_hashes=hex_hashes, attention_dp_rank=rank)
    all_steps = draw(steps(hex_hashes, block_size))
    bodies = []
    for step in all_steps:
        queue.publish(step)
        if draw(st.booleans()):
            bodies.append(json.dumps(queue.drain()).encode())
    bodies.append(json.dumps(queue.drain()).encode())
    return rank, block_size, all_steps, bodies


def feed_all(converter: TrtllmEventConverter, bodies: list[bytes]) -> list:
    return [action for body in bodies for action in converter.feed(body)]


# ---------------------------------------------------------------- (a) agreement


@given(engine_polls())
def test_polled_bodies_convert_to_the_events_the_field_table_says(polls) -> None:
    rank, block_size, all_steps, bodies = polls
    converter = TrtllmEventConverter(None if rank is None else [rank])
    actions = feed_all(converter, bodies)
    assert not any(isinstance(a, RankReset) for a in actions)
    assert all(a.rank == rank for a in actions)
    assert [e for a in actions for e in a.events] == [e for step in all_steps for ev in step for e in expected(ev, block_size)]
    c = converter.counters
    assert c.updated_events == sum(
        len(ev.block_hashes) for step in all_steps for ev in step if isinstance(ev, StoredEvent) and ev.moved_from is not None
    )
    assert c.malformed_events == c.unknown_events == c.unknown_fields == c.gaps == 0


# ---------------------------------------------------------------- hostile values

_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
JSON_VALUES = st.recursive(
    _SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12
)
# Fragments json.dumps never writes: NaN, numbers past every range, a lone surrogate, bytes that are not
# UTF-8, nesting past any recursion limit, a huge number of digits.
RAW_FRAGMENTS = st.one_of(
    st.sampled_from(
        [
            b"NaN",
            b"-Infinity",
            b"1e999",
            b'"\\ud800"',
            b'"\xff\xfe"',
            b'"\xc3("',
            b"18446744073709551616",
            b"-9223372036854775809",
            b"1" + b"0" * 5000,
        ]
    ),
    st.integers(1000, 3000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1000, 3000).map(lambda n: b'{"a":' * n + b"0" + b"}" * n),
)


def dumps(value: object) -> bytes:
    return json.dumps(value).encode()


HOSTILE_BODIES = JSON_VALUES.map(dumps) | RAW_FRAGMENTS
INSERTS = st.binary(min_size=1, max_size=9) | RAW_FRAGMENTS
FIELD_CHANGES = st.sampled_from(("replace", "replace", "drop", "add", "raw", "value", "type"))
NOT_A_TYPE = st.text(max_size=10).filter(lambda t: t not in ("stored", "removed", "updated", "created"))


def with_raw(value: object, raw: bytes) -> bytes:
    """`value` as JSON with its string "@RAW@" (wherever it sits) replaced by raw bytes."""
    return dumps(value).replace(b'"@RAW@"', raw, 1)


_QUEUE = TrtllmEventQueue(4, 0, WINDOW)  # only its JSON writer is used (`to_json`)


@st.composite
def one_event(draw) -> StoredEvent | RemovedEvent:
    hashes, parents = HASHES[False]
    if draw(st.booleans()):
        n = draw(st.integers(1, 3))
        return StoredEvent(
            draw(st.lists(hashes, min_size=n, max_size=n)), draw(parents), draw(token_ids(2 * n)), GPU, draw(namespaces())
        )
    return RemovedEvent(draw(st.lists(hashes, min_size=1, max_size=4)))


@st.composite
def hostile_event(draw, event_id: int) -> bytes:
    """One element: a valid event of id `event_id` with one field (at any depth) replaced, removed or
    added, a raw fragment in one of its fields, or no event at all."""
    event = {"event_id": event_id, "data": _QUEUE.to_json(draw(one_event()))[0], "window_size": WINDOW}
    how = draw(FIELD_CHANGES)
    if how == "value":
        return draw(HOSTILE_BODIES)
    # A field at any depth: the event's keys, data's, and the first block's and token's.
    holders = [event, event["data"]]
    if event["data"]["type"] == "stored":
        holders += [event["data"]["blocks"][0], event["data"]["blocks"][0]["tokens"][0]]
    holder = draw(st.sampled_from(holders))
    key = draw(st.sampled_from(sorted(k for k in holder if holder is not event or k != "event_id")))
    if how == "type":
        event["data"]["type"] = draw(NOT_A_TYPE)
    elif how == "drop":
        del holder[key]
    elif how == "add":
        holder[draw(st.text(max_size=8))] = draw(JSON_VALUES)
    elif how == "raw":
        holder[key] = "@RAW@"
        return with_raw(event, draw(RAW_FRAGMENTS))
    else:
        holder[key] = draw(JSON_VALUES)
    return dumps(event)


def feed_hostile(converter: TrtllmEventConverter, body: bytes) -> list | None:
    try:
        return bounded(converter.feed, body, body)
    except BodyError:
        return None


# ---------------------------------------------------------------- (b) hostility


@given(st.binary(max_size=256))
@example(b"[" + b"[" * 5000)  # nested past the recursion limit, unterminated
@example(b'[{"event_id": 1' + b"0" * 100_000 + b"}]")  # 100k digits
@example(b'["\\ud800"]')
def test_arbitrary_bytes_raise_only_body_errors(body: bytes) -> None:
    feed_hostile(TrtllmEventConverter(), body)


@given(engine_polls(), st.data())
def test_truncated_and_mutated_bodies_raise_only_body_errors(polls, data) -> None:
    *_, bodies = polls
    body = data.draw(st.sampled_from(bodies))
    at = data.draw(st.integers(0, max(0, len(body) - 1)))
    mutation = data.draw(MUTATIONS)
    if mutation == "truncate":
        body = body[:at]
    elif mutation == "flip" and body:
        body = body[:at] + bytes([body[at] ^ data.draw(st.integers(1, 255))]) + body[at + 1 :]
    elif mutation == "insert":
        body = body[:at] + data.draw(INSERTS) + body[at:]
    else:
        body = body[:at] + body[at + data.draw(st.integers(1, 9)) :]
    feed_hostile(TrtllmEventConverter(), body)


@given(HOSTILE_BODIES)
def test_any_json_value_as_the_body_raises_only_body_errors(body: bytes) -> None:
    feed_hostile(TrtllmEventConverter(), body)


@given(st.data())
def test_a_bad_event_is_counted_and_its_neighbours_apply(data) -> None:
    queue = TrtllmEventQueue(64, 16, WINDOW)
    before = data.draw(steps(False, 2))
    for step in before:
        queue.publish(step)
    head = queue.drain()
    bad = data.draw(hostile_event(queue.next_event_id))
    queue.next_event_id += 1
    after = data.draw(steps(False, 2))
    for step in after:
        queue.publish(step)
    tail = queue.drain()
    body = b"[" + b", ".join([dumps(e) for e in head] + [bad] + [dumps(e) for e in tail]) + b"]"
    converter = TrtllmEventConverter()
    actions = bounded(converter.feed, body, body)
    events = [e for a in actions if isinstance(a, RankEvents) for e in a.events]
    want_before = [e for step in before for ev in step for e in expected(ev, 2)]
    want_after = [e for step in after for ev in step for e in expected(ev, 2)]
    assert events[: len(want_before)] == want_before
    assert events[len(events) - len(want_after) :] == want_after
    kept = len(events) - len(want_before) - len(want_after)
    assert 0 <= kept <= 2  # a hostile stored event may still be readable, as up to two runs of block sizes
    c = converter.counters
    updated = sum(
        len(ev.block_hashes)
        for step in before + after
        for ev in step
        if isinstance(ev, StoredEvent) and ev.moved_from is not None
    )
    counted = c.malformed_events + c.unknown_events + c.window_filtered_events + c.updated_events - updated + c.rank_mismatches
    if kept == 0 and counted == 0 and not any(isinstance(a, RankReset) for a in actions):
        alone = TrtllmEventConverter()  # then it must be a readable event that says nothing (e.g. no blocks)
        assert [a for a in alone.feed(b"[" + bad + b"]") if a.events] == [] and alone.counters.malformed_events == 0
    assert counted <= 1
    assert sum(isinstance(a, RankReset) for a in actions) <= 1


@given(st.integers(0, 150), st.integers(1, 100))
def test_more_events_than_the_limit_are_refused_before_they_are_taken_apart(events: int, limit: int) -> None:
    removed = {"event_id": 0, "data": {"type": "removed", "block_hashes": [1]}, "window_size": WINDOW}
    for body in (dumps([0] * events), dumps([{**removed, "event_id": i} for i in range(events)])):
        try:
            actions = bounded(TrtllmEventConverter(max_events=limit).feed, body, body)
        except OversizeBodyError:
            assert events > limit
            continue
        except BodyError:
            continue
        assert events <= limit and len(actions) <= 1


# ---------------------------------------------------------------- regressions the properties found


@pytest.mark.parametrize(
    "bad",
    [
        b'{"event_id": 1, "data": {"type": "removed", "block_hashes": [1' + b"0" * 30 + b"]}}",
        b'{"event_id": 1, "window_size": 1e999, "data": {"type": "removed", "block_hashes": [1]}}',
        b'{"event_id": 1, "data": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"event_id": 1, "data": {"type": "\\ud800"}}',
        b'{"event_id": 1, "data": {"type": "\xff"}}',
    ],
    ids=["hash-past-u64", "number-past-float", "deep", "lone-surrogate", "not-utf8"],
)
def test_regression_one_unreadable_event_between_good_ones(bad: bytes) -> None:
    """Numbers past every range raised msgspec.ValidationError out of `feed` (and the poller's loop, which
    stopped the agent); deep nesting raised RecursionError; a lone surrogate or invalid UTF-8 lost the body."""
    good = [dumps({"event_id": i, "data": {"type": "removed", "block_hashes": [i]}, "window_size": WINDOW}) for i in (0, 2)]
    converter = TrtllmEventConverter()
    actions = converter.feed(b"[" + b",".join([good[0], bad, good[1]]) + b"]")
    assert [e.block_hashes for a in actions if isinstance(a, RankEvents) for e in a.events] == [[0], [2]]
    assert converter.counters.malformed_events + converter.counters.unknown_events == 1


def test_hex_and_int_hashes_of_one_value_are_one_id() -> None:
    h = 2**64 - 5
    body = dumps([{"event_id": 0, "data": {"type": "removed", "block_hashes": [h, f"{h:064x}"]}, "window_size": 1}])
    assert TrtllmEventConverter().feed(body)[0].events == [BlockRemoved([h, h])]
