"""The same-node route's wire: a hello, then frames, each one Arrow IPC message.

Why apart from `local.py`: these are the bytes both ends must agree on and the loops that
read and write them whole, kept free of the server's threads and the buffer's contract,
so a second receiver (a native one, say) reads the hello and the schema with the same
code before it takes over a connection.

After the hello (`HELLO`: magic, token bytes, producer id bytes; answered b"\\x00" when the
token is the run's, b"\\x01" when not), frames of `FRAME` (sequence, kind, length) + one IPC
message. The schema goes once per connection (kind SCHEMA, no ack). Each batch (kind
BATCH) is answered `ACK` (sequence, status), or by status UNAVAILABLE / REFUSED, then
`!I` + an error text, after which the server closes the connection.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import numpy as np

MAGIC = b"VHPC-RL1"
HELLO = struct.Struct("!8sII")    # magic, token bytes, producer id bytes
FRAME = struct.Struct("!QBQ")     # sequence, kind, message bytes
ACK = struct.Struct("!QB")        # sequence, status
SCHEMA, BATCH = 0, 1
STATUS = {0: "queued", 1: "duplicate"}
UNAVAILABLE, REFUSED = 254, 255   # then !I + an error text; the server closes the connection
MAX_MESSAGE = 1 << 40
IOV_MAX = 1024                    # Linux's limit on the buffers of one sendmsg


def recv_exact(conn: socket.socket, view: memoryview) -> bool:
    """Fill `view`; False on an orderly close before its first byte, EOFError mid-way."""
    got = 0
    while got < len(view):
        # MSG_WAITALL: the kernel fills the whole view before waking us (one GIL round trip, not one per segment)
        n = conn.recv_into(view[got:], 0, socket.MSG_WAITALL)
        if n == 0:
            if got == 0:
                return False
            raise EOFError(f"connection closed after {got} of {len(view)} bytes")
        got += n
    return True


def read_hello(conn: socket.socket) -> tuple[bytes, bytes] | None:
    """A producer's hello: (the token it presented, its id, both raw); None if it closed first."""
    head = bytearray(HELLO.size)
    if not recv_exact(conn, memoryview(head)):
        return None
    magic, token_len, producer_len = HELLO.unpack(head)
    if magic != MAGIC or token_len > 4096 or producer_len > 4096:
        raise ValueError("not a rollout producer's hello")
    rest = bytearray(token_len + producer_len)
    recv_exact(conn, memoryview(rest))
    return bytes(rest[:token_len]), bytes(rest[token_len:])


def read_frame(conn: socket.socket, head: bytearray) -> tuple[int, int, np.ndarray] | None:
    """The next frame, (sequence, kind, its message in fresh memory); None on an orderly close.

    `head` is the caller's reused `FRAME.size` buffer. The message is read into memory
    that the batch will own: no second copy."""
    if not recv_exact(conn, memoryview(head)):
        return None
    seq, kind, nbytes = FRAME.unpack(head)
    if nbytes > MAX_MESSAGE:
        raise ValueError(f"a {nbytes}-byte message")
    body = np.empty(nbytes, dtype=np.uint8)
    recv_exact(conn, memoryview(body))
    return seq, kind, body


def sendmsg_all(conn: socket.socket, parts: list[Any], nbytes: int) -> None:
    """`sendmsg` of all `nbytes` of the parts, resumed after a partial send (a batch over SO_SNDBUF)."""
    sent = conn.sendmsg(parts) if len(parts) <= IOV_MAX else 0
    if sent == nbytes:  # the usual case: one call, no views made
        return
    views = [memoryview(p).cast("B") for p in parts]
    while True:
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if not views:
            return
        views[0] = views[0][sent:]
        sent = conn.sendmsg(views[:IOV_MAX])
