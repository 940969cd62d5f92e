"""Unknown fields: tolerated, but counted.

The wire structs forbid unknown fields, so a typed decode of an event from a newer engine release
fails instead of silently dropping what that release added. The decoders then call
`strip_unknown_fields` on the generic decode of that one event: it removes every map key and every
trailing array element the declared type does not know (at any depth), says where they were, and
the result is converted to the declared type as usual. Only events that really carry unknown
fields take this path, so the fast path stays one typed decode per batch.
"""

from __future__ import annotations

from typing import Any

import msgspec.inspect as mi

_type_infos: dict[Any, mi.Type] = {}


def strip_unknown_fields(value: Any, typ: Any) -> tuple[Any, list[str]]:
    """(value without the fields `typ` does not declare, paths of what was removed)."""
    info = _type_infos.get(typ)
    if info is None:
        info = _type_infos[typ] = mi.type_info(typ)
    unknown: list[str] = []
    cleaned = _strip(value, info, "$", unknown)
    return cleaned, sorted(set(unknown))


def _has_structs(info: mi.Type) -> bool:
    """Whether a value of this type can hold a struct (anything else has no fields to be unknown)."""
    if isinstance(info, mi.StructType):
        return True
    if isinstance(info, mi.UnionType):
        return any(_has_structs(t) for t in info.types)
    if isinstance(info, (mi.ListType, mi.VarTupleType)):
        return _has_structs(info.item_type)
    return False


def _strip(value: Any, info: mi.Type, path: str, unknown: list[str]) -> Any:
    if isinstance(info, mi.StructType):
        return _strip_struct(value, info, path, unknown)
    if isinstance(info, mi.UnionType):
        member = _union_member(value, info)
        return value if member is None else _strip(value, member, path, unknown)
    if isinstance(info, (mi.ListType, mi.VarTupleType)) and isinstance(value, list) and _has_structs(info.item_type):
        return [_strip(v, info.item_type, f"{path}[]", unknown) for v in value]
    return value  # scalars and lists of scalars (token ids, hashes): nothing to strip


def _strip_struct(value: Any, info: mi.StructType, path: str, unknown: list[str]) -> Any:
    if info.array_like:
        if not isinstance(value, list):
            return value
        offset = 0 if info.tag is None else 1
        known = offset + len(info.fields)
        if len(value) > known:
            unknown.append(f"{path}[{known}:]")
        return value[:offset] + [
            _strip(v, f.type, f"{path}[{i + offset}]", unknown) for i, (v, f) in enumerate(zip(value[offset:known], info.fields))
        ]
    if not isinstance(value, dict):
        return value
    fields = {f.encode_name: f for f in info.fields}
    out = {}
    for key, v in value.items():
        if info.tag is not None and key == info.tag_field:
            out[key] = v
            continue
        field = fields.get(key)
        if field is None:
            unknown.append(f"{path}.{key}")
            continue
        out[key] = _strip(v, field.type, f"{path}.{key}", unknown)
    return out


def _union_member(value: Any, info: mi.UnionType) -> mi.Type | None:
    """The member a value decodes as: a tagged struct by its tag, else the one container of its shape."""
    for member in info.types:
        if isinstance(member, mi.StructType) and member.tag is not None:
            if member.array_like and isinstance(value, list) and value and value[0] == member.tag:
                return member
            if not member.array_like and isinstance(value, dict) and value.get(member.tag_field) == member.tag:
                return member
    for member in info.types:
        if isinstance(value, list) and (
            isinstance(member, (mi.ListType, mi.VarTupleType)) or (isinstance(member, mi.StructType) and member.array_like)
        ):
            return member
        if isinstance(value, dict) and isinstance(member, mi.StructType) and not member.array_like:
            return member
    return None
