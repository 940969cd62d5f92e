"""The elements of a JSON array as byte slices, found without parsing them.

msgspec takes a JSON body apart recursively, up to Python's recursion limit, and refuses the whole
body for one string it cannot read (a lone UTF-16 surrogate escape). The pull-path decoder then
needs each top-level element on its own, so the events around the bad one still apply. A regular
expression finds the strings (escapes included) and the brackets; brackets outside strings give
the depth, and commas at depth 1 separate the elements. Nothing recurses.
"""

from __future__ import annotations

import re

# A string (possessive: no backtracking whatever its content), or one structural character.
_TOKENS = re.compile(rb'"(?:[^"\\]++|\\.)*+"|[\[\]{},]', re.DOTALL)
_OPEN, _CLOSE, _COMMA = frozenset(b"[{"), frozenset(b"]}"), ord(",")


class ScanError(ValueError):
    """The bytes are not a JSON array whose elements can be told apart."""


def split_array(body: bytes) -> list[bytes]:
    """The top-level elements of the JSON array `body`, stripped (an empty one where two commas meet)."""
    start = len(body) - len(body.lstrip())
    if body[start : start + 1] != b"[":
        raise ScanError("not a JSON array")
    depth, out, element = 0, [], start + 1
    for match in _TOKENS.finditer(body, start):
        c = body[match.start()]
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
            if depth == 0:
                last = body[element : match.start()].strip()
                if last or out:
                    out.append(last)
                if body[match.end() :].strip():
                    raise ScanError("trailing bytes after the array")
                return out
        elif c == _COMMA and depth == 1:
            out.append(body[element : match.start()].strip())
            element = match.end()
    raise ScanError("unterminated array")
