"""xds-protos (Envoy's protos, the `epp` extra) ships stale copies of opentelemetry-proto's and
googleapis-common-protos' modules over theirs (grpc/grpc issue 42926; still so in 1.85.0).
`make venv` puts the owners' files back (scripts/restore_shadowed_protos.py); these tests fail
when an environment has both installed and the overwrite was not undone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "restore_shadowed_protos.py"


def test_no_module_of_opentelemetry_proto_or_googleapis_is_overwritten() -> None:
    check = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60, check=False)
    assert check.returncode == 0, check.stderr


def test_envoy_ext_proc_and_the_otlp_exporter_import_together() -> None:
    """The exporter needs opentelemetry-proto's `InstrumentationScope`, which xds-protos' copy lacks."""
    code = (
        "from envoy.service.ext_proc.v3 import external_processor_pb2, external_processor_pb2_grpc\n"
        "import envoy.config.trace.v3.opentelemetry_pb2\n"
        "from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter\n"
        "from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
