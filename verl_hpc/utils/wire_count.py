"""Bytes a process has put on TCP, as the kernel counts them (`ss`'s per-socket bytes_sent).

Why the kernel's count: the data plane's scaling claims are about bytes on the wire per
rank (a broadcast tree sends a model several times from its root; a chain once), and a
count taken below gloo, NCCL's socket transport and gRPC is exact whatever each library
does inside. Only sockets open at both readings are compared, so take both while the
process's connections are up (gloo's pairs live as long as their process group).
"""

from __future__ import annotations

import re
import subprocess

_USER = re.compile(r"pid=(\d+),")
_SENT = re.compile(r"\bbytes_sent:(\d+)")


def tcp_bytes_sent(pid: int) -> int:
    """Sum of bytes_sent over the established TCP sockets that process `pid` holds."""
    out = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True,
                         check=True).stdout
    return sum_for_pid(out, pid)


def sum_for_pid(ss_output: str, pid: int) -> int:
    """`ss -tinpH` prints a socket line (with `users:(("name",pid=N,fd=M))`) then its indented info line."""
    total, mine = 0, False
    for line in ss_output.splitlines():
        if line[:1] not in (" ", "\t"):
            mine = str(pid) in _USER.findall(line)
        elif mine and (sent := _SENT.search(line)):
            total += int(sent.group(1))
    return total
