#!/usr/bin/env python3
"""Undo what installing xds-protos does to opentelemetry-proto and googleapis-common-protos.

xds-protos (Envoy's protos for `kvroute epp`, the `epp` extra) ships its own, older copies of
`opentelemetry/proto/...` and `google/api/...` modules at the paths those two distributions own
(grpc/grpc issues 42925 and 42926; still so in xds-protos 1.85.0). Whichever is installed last
wins, and xds-protos' `common_pb2` predates `InstrumentationScope`, so the OTLP exporter then fails
to import. Envoy's protos import neither copy's newer-or-older names in a way that breaks (both
import and serve once the owners' files are back), so the fix is to put the owners' files back:
reinstall each distribution whose files no longer match its own RECORD, at the version installed,
without dependencies.

    python scripts/restore_shadowed_protos.py          # reinstall what was overwritten (make venv runs it)
    python scripts/restore_shadowed_protos.py --check  # exit 1 naming what is overwritten
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
from importlib import metadata

SHADOWED = ("opentelemetry-proto", "googleapis-common-protos")


def overwritten(dist: metadata.Distribution) -> list[str]:
    """Files of `dist` whose content differs from the hash its RECORD holds."""
    changed = []
    for file in dist.files or ():
        if file.hash is None or file.hash.mode != "sha256" or not str(file).endswith(".py"):
            continue
        try:
            data = file.locate().read_bytes()
        except FileNotFoundError:
            changed.append(str(file))
            continue
        if base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode() != file.hash.value:
            changed.append(str(file))
    return changed


def shadowed() -> dict[str, tuple[str, list[str]]]:
    """name -> (installed version, its overwritten files), for the distributions xds-protos overlaps."""
    out = {}
    for name in SHADOWED:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if files := overwritten(dist):
            out[name] = (dist.version, files)
    return out


def main(argv: list[str]) -> int:
    found = shadowed()
    if "--check" in argv:
        for name, (version, files) in found.items():
            print(
                f"{name} {version}: {len(files)} files overwritten by another distribution (e.g. {files[0]}); "
                f"run scripts/restore_shadowed_protos.py",
                file=sys.stderr,
            )
        return 1 if found else 0
    if found:
        pins = [f"{name}=={version}" for name, (version, _) in found.items()]
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", *pins], check=True)
        left = shadowed()
        if left:
            print(f"still overwritten after reinstalling: {', '.join(left)}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
