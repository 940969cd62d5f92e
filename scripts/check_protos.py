"""Are the committed stubs in kvroute/v1 those of the .proto files in protos/? Compares what matters,
the schema, not the generator's formatting: each .proto is compiled (grpc_tools' protoc, the pinned
grpcio-tools of the dev extra) to its FileDescriptorProto and compared with the one embedded in its
`*_pb2.py` (`DESCRIPTOR.serialized_pb`), and every service method of the schema must be served by the
`*_pb2_grpc.py` stub under its wire path ('/package.Service/Method'), and nothing else.

A newer generator's different code passes; a .proto changed without `make protos` fails, naming the
first difference. Exit 0 when up to date, 1 when stale (or a stub is missing), 2 on usage errors.

    python scripts/check_protos.py [--protos protos] [--stubs kvroute/v1]
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2, text_format

ROOT = Path(__file__).resolve().parents[1]


def compile_protos(protos: Path) -> list[descriptor_pb2.FileDescriptorProto]:
    """The FileDescriptorProtos protoc makes of every .proto under `protos` (no source info: comments
    and layout are not schema)."""
    files = sorted(str(p.relative_to(protos)) for p in protos.rglob("*.proto"))
    if not files:
        raise SystemExit(f"check_protos: no .proto under {protos}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        protoc = subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", f"-I{protos}", f"--descriptor_set_out={out}", *files],
            capture_output=True,
            text=True,
            check=False,
        )
        if protoc.returncode != 0:
            raise SystemExit(f"check_protos: protoc failed:\n{protoc.stderr}")
        return list(descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file)


def default_json_name(field_name: str) -> str:
    """protoc's JSON name of a field: underscores dropped, the letter after each one upper-cased."""
    parts = field_name.split("_")
    return parts[0] + "".join(part[:1].upper() + part[1:] for part in parts[1:])


def without_default_json_names(fd: descriptor_pb2.FileDescriptorProto) -> descriptor_pb2.FileDescriptorProto:
    """protoc fills every field's json_name in a descriptor set; generated code keeps only explicit ones
    (`[json_name = ...]`). Cleared where it is the default, so both sides say the same."""
    fd = descriptor_pb2.FileDescriptorProto.FromString(fd.SerializeToString())
    messages = list(fd.message_type)
    fields = list(fd.extension)
    while messages:
        message = messages.pop()
        messages.extend(message.nested_type)
        fields.extend(message.field)
        fields.extend(message.extension)
    for field in fields:
        if field.json_name == default_json_name(field.name):
            field.ClearField("json_name")
    return fd


def embedded_descriptor(pb2: Path) -> descriptor_pb2.FileDescriptorProto:
    """The FileDescriptorProto a generated `*_pb2.py` registers, read by running it (this process loads
    no other copy of it, so its registration cannot clash)."""
    spec = importlib.util.spec_from_file_location(f"_check_protos_{pb2.stem}", pb2)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)


def stub_methods(grpc_stub: Path) -> set[str]:
    """The wire paths ('/package.Service/Method') a `*_pb2_grpc.py` calls and serves."""
    return set(re.findall(r"""['"](/[A-Za-z_][\w.]*/[A-Za-z_]\w*)['"]""", grpc_stub.read_text()))


def schema_methods(fd: descriptor_pb2.FileDescriptorProto) -> set[str]:
    prefix = f"{fd.package}." if fd.package else ""
    return {f"/{prefix}{service.name}/{method.name}" for service in fd.service for method in service.method}


def differences(protos: Path, stubs: Path) -> list[str]:
    problems = []
    for fd in compile_protos(protos):
        stem = Path(fd.name).stem
        pb2, grpc_stub = stubs / f"{stem}_pb2.py", stubs / f"{stem}_pb2_grpc.py"
        if not pb2.exists():
            problems.append(f"{fd.name}: no generated {pb2}")
            continue
        committed, fd = without_default_json_names(embedded_descriptor(pb2)), without_default_json_names(fd)
        if committed != fd:
            diff = difflib.unified_diff(
                text_format.MessageToString(committed).splitlines(),
                text_format.MessageToString(fd).splitlines(),
                f"{pb2} (committed)",
                f"{fd.name} (compiled)",
                lineterm="",
                n=2,
            )
            problems.append(f"{fd.name}: the schema differs from {pb2}'s:\n" + "\n".join(list(diff)[:60]))
        wanted = schema_methods(fd)
        if wanted or grpc_stub.exists():
            served = stub_methods(grpc_stub) if grpc_stub.exists() else set()
            if served != wanted:
                problems.append(
                    f"{fd.name}: {grpc_stub} serves {sorted(served - wanted) or 'no extra method'}"
                    f" beyond the schema and lacks {sorted(wanted - served) or 'none'}"
                )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--protos", type=Path, default=ROOT / "protos", help="the .proto root (protoc's -I)")
    parser.add_argument("--stubs", type=Path, default=ROOT / "kvroute" / "v1", help="the generated stubs")
    args = parser.parse_args(argv)
    problems = differences(args.protos, args.stubs)
    for problem in problems:
        print(f"stale generated stubs: {problem}", file=sys.stderr)
    if problems:
        print("run: make protos", file=sys.stderr)
        return 1
    print("generated stubs match protos/ (schema and service methods)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
