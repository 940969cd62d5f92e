"""Cache tiers: the one place an engine's medium name becomes a kvroute tier.

Engines name where a block sits in their own words (docs/wire-formats.md#vllm-medium-locality-and-kv-groups,
docs/wire-formats.md#sglang-events-per-version): vLLM "GPU" / "CPU" (and LMCache's "CPU"), SGLang
"GPU" / "CPU_PINNED" / "DISK" / "EXTERNAL", offload connectors "STORAGE", "FS", "OBJ". kvroute has three
tiers, `kvroute.v1.Tier` on the wire: gpu, cpu (host memory) and disk (anything slower, and any name
we do not know: the resolver counts those). TensorRT-LLM's pull path carries no medium: its blocks
count as gpu (worker_agent/trtllm_events.py).
"""

from __future__ import annotations

from enum import StrEnum

from kvroute.v1 import kvroute_pb2 as pb


class Tier(StrEnum):
    """A tier by its name, which is also its label in the agent's /metrics and /state."""

    GPU = "gpu"
    CPU = "cpu"
    DISK = "disk"

    @property
    def wire(self) -> pb.Tier:
        """This tier as `kvroute.v1.Tier`."""
        return _WIRE[self]


_WIRE = {Tier.GPU: pb.TIER_GPU, Tier.CPU: pb.TIER_CPU, Tier.DISK: pb.TIER_DISK}
TIERS = tuple(Tier)

# Engine medium names, lower-cased, -> tier.
ENGINE_MEDIA: dict[str, Tier] = {
    "gpu": Tier.GPU,
    "cpu": Tier.CPU,
    "cpu_pinned": Tier.CPU,
    "storage": Tier.DISK,
    "disk": Tier.DISK,
    "fs": Tier.DISK,
    "obj": Tier.DISK,
    "external": Tier.DISK,
}


def normalize_medium(value: str | None) -> str:
    """A decoded event's medium as the resolver keeps it: lower-cased, an absent one is "gpu"."""
    return "gpu" if value is None else value.lower()


def tier_of_medium(medium: str) -> Tier | None:
    """The tier of a normalised medium name; None for a name we do not know."""
    return ENGINE_MEDIA.get(medium)
