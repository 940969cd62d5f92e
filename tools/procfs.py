"""What /proc says about a process, for the benches: its resident memory and its open files.

rss_bytes()            # this process
rss_bytes(child.pid)   # another; 0 when it has gone
open_fds(child.pid)
"""

from __future__ import annotations

import os
from pathlib import Path


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size (VmRSS) in bytes; 0 for a process that has gone or a kernel thread."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def open_fds(pid: int | str = "self") -> int:
    """Open file descriptors of the process."""
    return len(os.listdir(f"/proc/{pid}/fd"))
