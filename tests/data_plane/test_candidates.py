"""The one candidate builder the router, the simulator and the burst bench share."""

from __future__ import annotations

from kvroute.block_keys import prompt_block_keys
from kvroute.data_plane.cp_link.control_plane_client import KnownWorker
from kvroute.data_plane.cp_link.inflight import RouterInflight
from kvroute.data_plane.decision.candidates import build_candidates
from kvroute.fleet.answer import IndexColumns
from kvroute.v1 import kvroute_pb2 as pb

BS = 16


def _known(*ids: str, block_size: int = BS) -> list[KnownWorker]:
    return [
        KnownWorker(
            w, "m", f"http://{w}", block_size, pb.WorkerLoad(running_requests=i, waiting_requests=1), cached_blocks=10 * i
        )
        for i, w in enumerate(ids)
    ]


def _columns(ids: list[str], matched: list[int], **extra: list) -> IndexColumns:
    n = len(ids)
    return IndexColumns(
        ids,
        matched,
        cpu_blocks=extra.get("cpu", [0] * n),
        disk_blocks=extra.get("disk", [0] * n),
        speculative_blocks=[0] * n,
        reserved_requests=extra.get("reserved", [0] * n),
        reserved_prefill_tokens=extra.get("prefill", [0] * n),
        running_requests=extra.get("running", [0] * n),
        waiting_requests=extra.get("waiting", [0] * n),
        kv_usage=extra.get("usage", [0.0] * n),
        kv_capacity_tokens=extra.get("capacity", [0] * n),
    )


def test_columns_give_the_index_match_tiers_and_reservations_plus_own_inflight() -> None:
    tokens = list(range(100, 164))  # 4 blocks
    keys = prompt_block_keys(tokens, BS, "m")
    own = RouterInflight()
    own.start("b", 40, keys[:3])  # this router has 3 of the prompt's blocks in flight at b
    cols = _columns(
        ["a", "b", "z"],
        [4, 1, 9],
        cpu=[1, 0, 0],
        reserved=[2, 0, 0],
        prefill=[100, 0, 0],
        running=[3, 4, 5],
        waiting=[0, 1, 0],
        usage=[0.5, 0.25, 0.0],
        capacity=[16_384, 0, 0],
    )
    out = build_candidates(_known("a", "b"), own, {BS: keys}, len(tokens), cols)
    assert [c.worker_id for c in out] == ["a", "b"]  # "z" is not known here yet: left out
    a, b = out
    assert (a.cached_tokens, a.cpu_cached_tokens, a.inflight_requests, a.pending_prefill_tokens) == (64, 16, 2, 100)
    assert (a.running_requests, a.waiting_requests, a.kv_usage, a.endpoint) == (3, 0, 0.5, "http://a")
    assert (a.kv_capacity_tokens, b.kv_capacity_tokens) == (16_384, 0)
    assert b.cached_tokens == 3 * BS  # own in-flight prompt beats the index's 1 block
    assert (b.inflight_requests, b.pending_prefill_tokens, b.worker_cached_blocks) == (1, 40, 10)


def test_without_columns_it_fails_open_over_the_known_fleet_on_load_and_own_prompts() -> None:
    tokens = list(range(200, 232))
    keys = prompt_block_keys(tokens, BS, "m")
    own = RouterInflight()
    own.start("a", 32, keys)
    out = build_candidates(_known("a", "b"), own, {BS: keys}, len(tokens))
    assert [(c.worker_id, c.cached_tokens, c.inflight_requests, c.running_requests) for c in out] == [
        ("a", 32, 1, 0),
        ("b", 0, 0, 1),
    ]


def test_avoided_workers_are_left_out_unless_every_known_worker_is_avoided() -> None:
    known = _known("a", "b")
    cols = _columns(["a", "b"], [0, 0])
    assert [c.worker_id for c in build_candidates(known, RouterInflight(), {}, 10, cols, frozenset({"a"}))] == ["b"]
    assert [c.worker_id for c in build_candidates(known, RouterInflight(), {}, 10, None, frozenset({"a"}))] == ["b"]
    both = frozenset({"a", "b"})
    assert [c.worker_id for c in build_candidates(known, RouterInflight(), {}, 10, cols, both)] == ["a", "b"]
    # An answer naming only avoided workers leaves nothing: the router then fails open over the rest.
    assert build_candidates(known, RouterInflight(), {}, 10, _columns(["a"], [3]), frozenset({"a"})) == []


def test_a_pb_answer_reads_the_same_as_plain_columns() -> None:
    cols = pb.WorkerColumns(
        worker_id=["a"],
        matched_blocks=[2],
        cpu_blocks=[0],
        disk_blocks=[1],
        reserved_requests=[1],
        reserved_prefill_tokens=[7],
        running_requests=[2],
        waiting_requests=[3],
        kv_usage=[0.5],
        kv_capacity_tokens=[4096],
    )
    plain = _columns(["a"], [2], disk=[1], reserved=[1], prefill=[7], running=[2], waiting=[3], usage=[0.5], capacity=[4096])
    known = _known("a")
    assert build_candidates(known, RouterInflight(), {}, 100, cols) == build_candidates(known, RouterInflight(), {}, 100, plain)


def test_kv_capacity_comes_from_the_answer_or_else_the_known_workers_last_heartbeat() -> None:
    known = [KnownWorker("a", "m", "http://a", BS, pb.WorkerLoad(kv_usage=0.5, kv_capacity_tokens=8192))]
    newer = _columns(["a"], [0], capacity=[16_384])
    assert build_candidates(known, RouterInflight(), {}, 10, newer)[0].kv_capacity_tokens == 16_384
    older = _columns(["a"], [0])
    older.kv_capacity_tokens = []  # a control plane from before the column
    assert build_candidates(known, RouterInflight(), {}, 10, older)[0].kv_capacity_tokens == 8192
    assert build_candidates(known, RouterInflight(), {}, 10, None)[0].kv_capacity_tokens == 8192  # failing open
