"""Moving rollouts from generation workers to the trainer.

`secret` creates and reads the per-run token; `flight` is the Arrow Flight transport.
Why the lazy import: `pyarrow.flight` pulls in gRPC, which code that only needs the
secret (the launcher) should not pay for or depend on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from verl_hpc.transport.secret import create_run_secret, read_run_secret, secret_path

if TYPE_CHECKING:
    from verl_hpc.transport.rollouts.flight import RolloutFlightClient, RolloutFlightServer

__all__ = ["RolloutFlightClient", "RolloutFlightServer", "create_run_secret", "read_run_secret", "secret_path"]


def __getattr__(name: str) -> Any:
    if name in ("RolloutFlightClient", "RolloutFlightServer"):
        from verl_hpc.transport.rollouts import flight

        return getattr(flight, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
