"""The same-node route's wire (transport/rollouts/frames.py): a hello and frames, read whole or refused."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from verl_hpc.transport.rollouts import frames


def test_a_hello_gives_the_token_and_the_producer_and_a_close_gives_none() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(frames.HELLO.pack(frames.MAGIC, 3, 5) + b"tokprod1")
        assert frames.read_hello(ours) == (b"tok", b"prod1")
        theirs.close()
        assert frames.read_hello(ours) is None


def test_a_stranger_is_not_taken_for_a_producer() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(frames.HELLO.pack(b"GET / HT", 3, 5))
        with pytest.raises(ValueError, match="not a rollout producer's hello"):
            frames.read_hello(ours)


def test_frames_come_whole_into_fresh_memory_and_oversized_ones_are_refused() -> None:
    ours, theirs = socket.socketpair()
    head = bytearray(frames.FRAME.size)
    with ours, theirs:
        payload = bytes(range(256)) * 300
        frames.sendmsg_all(theirs, [frames.FRAME.pack(7, frames.BATCH, len(payload)), payload],
                           frames.FRAME.size + len(payload))
        seq, kind, body = frames.read_frame(ours, head)  # type: ignore[misc]
        assert (seq, kind) == (7, frames.BATCH) and isinstance(body, np.ndarray) and body.tobytes() == payload
        theirs.sendall(frames.FRAME.pack(8, frames.BATCH, frames.MAX_MESSAGE + 1))
        with pytest.raises(ValueError, match="byte message"):
            frames.read_frame(ours, head)
        theirs.sendall(frames.FRAME.pack(9, frames.BATCH, 10) + b"abc")
        theirs.close()
        with pytest.raises(EOFError, match="connection closed after 3 of 10 bytes"):
            frames.read_frame(ours, head)
        assert frames.read_frame(ours, head) is None
