"""`kvroute_build_info{component, version, python}` = 1 on every kvroute process's /metrics, so a
dashboard can tell which release runs where (the Prometheus `*_build_info` convention)."""

from __future__ import annotations

import importlib.metadata
import platform

from prometheus_client import CollectorRegistry, Gauge


def kvroute_version() -> str:
    try:
        return importlib.metadata.version("kvroute")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def register_build_info(registry: CollectorRegistry, component: str) -> None:
    """Add the build-info gauge for `component` (router, control_plane, agent) to `registry`."""
    Gauge(
        "kvroute_build_info",
        "Always 1; the labels say which kvroute release and Python this process runs",
        ["component", "version", "python"],
        registry=registry,
    ).labels(component, kvroute_version(), platform.python_version()).set(1)
