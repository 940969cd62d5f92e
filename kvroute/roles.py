"""Worker roles under prefill/decode disaggregation: what a worker registers (`RegisterWorker.role`).

    role = parse_role("prefill")   # "prefill" | "decode" | "" (whole requests); ValueError otherwise

"" (spelled "both" on command lines, and the default) is a worker that serves whole requests. A
router in P/D mode (`kvroute router --pd`) sends prefill legs only to "prefill" workers and decode
legs only to "decode" workers; other routers ignore roles.
"""

from __future__ import annotations

PREFILL = "prefill"
DECODE = "decode"
BOTH = ""
ROLE_CHOICES = ("prefill", "decode", "both")  # command-line spellings


def parse_role(text: str) -> str:
    """A role as registered: "prefill", "decode" or "" (both). ValueError names the choices."""
    value = text.strip().lower()
    if value in ("", "both"):
        return BOTH
    if value in (PREFILL, DECODE):
        return value
    raise ValueError(f"role must be one of {', '.join(ROLE_CHOICES)}, got {text!r}")
