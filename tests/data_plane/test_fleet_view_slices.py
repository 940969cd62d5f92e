"""A router whose view of the fleet fell behind gets long Follow messages; its follower applies them a
slice at a time, so the router's decisions run in between on a state the control plane had, and the
view still ends equal to the control plane's."""

from __future__ import annotations

import asyncio
import random

from kvroute.control_plane.server import ControlPlaneConfig, ControlPlaneServer
from kvroute.data_plane.cp_link import fleet_view
from kvroute.data_plane.cp_link.control_plane_client import ControlPlaneClient
from kvroute.data_plane.cp_link.fleet_view import FleetView
from kvroute.fleet.entries import BlockOp, Op, RegisterBody
from kvroute.prefix_index import Tier
from tests.helpers import MODEL, eventually


async def test_a_long_message_is_applied_in_slices_with_other_work_in_between(monkeypatch) -> None:
    monkeypatch.setattr(fleet_view, "APPLY_SLICE_S", 0.0)  # a slice per change: every state is seen
    server = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0", heartbeat_timeout_s=600))
    port = await server.start()
    view = FleetView("slices")
    client = ControlPlaneClient(f"127.0.0.1:{port}", use_session=False, view=view)
    client.start()
    ticks: list[int] = []

    async def decisions() -> None:  # what a router's requests do meanwhile: read the view, let others run
        while True:
            if view.state is not None:
                ticks.append(view.state.index.entry_count())
            await asyncio.sleep(0)

    ticker = None
    try:
        await eventually(lambda: view.synced, 10, what="the view's first snapshot")
        applier = server.state.applier
        record = applier.register("w0", RegisterBody(MODEL, "sim", 4, "http://w0", "", [], None, "i0", ""), False)
        await eventually(lambda: view.state.registry.get("w0") is not None, 10, what="w0 in the view")
        batches = 300
        rng = random.Random(3)
        # Applied with no await in between: the follower's next message carries all of them.
        for seq in range(1, batches + 1):
            applier.apply_batch(record, seq, False, [BlockOp(Op.STORED, Tier.GPU, [rng.getrandbits(64)])])
        ticker = asyncio.create_task(decisions())
        await eventually(lambda: view.position.seq == server.feed.seq, 10, what="the view caught up")
        assert view.state.index.entry_count() == batches
        seen = sorted(set(ticks))
        # Decisions ran while the message applied, on the states after its changes.
        between = [n for n in seen if 0 < n < batches]
        assert len(between) >= 5, seen
    finally:
        if ticker is not None:
            ticker.cancel()
        await client.close()
        await server.stop(0)


async def test_a_large_worker_comes_in_snapshot_chunks_the_router_runs_between(monkeypatch) -> None:
    monkeypatch.setattr(fleet_view, "APPLY_SLICE_S", 0.0)  # a slice per change
    server = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0", heartbeat_timeout_s=600))
    port = await server.start()
    applier = server.state.applier
    record = applier.register("big", RegisterBody(MODEL, "sim", 4, "http://big", "", [], None, "i0", ""), False)
    rng = random.Random(4)
    keys = [rng.getrandbits(64) for _ in range(60_000)]
    applier.apply_batch(record, 1, True, [BlockOp(Op.STORED, Tier.GPU, keys)])
    view = FleetView("chunks")
    building: list[bool] = []

    async def decisions() -> None:  # a router serving (on load alone) while its first snapshot builds
        while True:
            building.append(view._pending is not None)
            await asyncio.sleep(0)

    ticker = asyncio.create_task(decisions())
    client = ControlPlaneClient(f"127.0.0.1:{port}", use_session=False, view=view)
    client.start()
    try:
        await eventually(lambda: view.synced, 30, what="the view's snapshot")
        assert view.state.index.worker_keys(view.state.registry.get("big").slot, Tier.GPU) == set(keys)
        # The worker's 60,000 keys came as several changes, with the router's other work run between them.
        assert sum(building) >= 6, sum(building)
    finally:
        ticker.cancel()
        await client.close()
        await server.stop(0)
