"""Shared-cluster security: owner-only run directories and secrets, no secret in any log, the
Flight endpoint refuses every client without this run's token, and user code is imported only
from the path configured (and only when no one else could have changed it). The threat model
and what torch's TCPStore rendezvous cannot do are in docs/security.md. Related tests:
tests/transport/test_flight.py (no/wrong token refused, 0600 token file), tests/checkpoint/test_checkpoint.py
(a pickled payload in checkpoint metadata is refused and never runs).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pyarrow.flight as flight
import pytest

from tests.reliability.runs import train
from tests.reliability.test_bad_input import run_main
from verl_hpc.transport.rollouts import RolloutFlightClient, RolloutFlightServer, create_run_secret

pytestmark = pytest.mark.slow


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_split_run_keeps_its_secret_private_and_out_of_every_log(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    proc = train(run_dir, tiny_model_dir, "trainer.total_steps=2", "logging.level=debug",
                 config="configs/quickstart_split.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    token_file = run_dir / "secrets" / "flight_token"
    assert _mode(run_dir) == 0o700 and _mode(run_dir / "secrets") == 0o700 and _mode(token_file) == 0o600
    token = token_file.read_text().strip()
    assert len(token) == 64
    assert token not in proc.stdout and token not in proc.stderr
    searched = [p for p in run_dir.rglob("*") if p.is_file() and p != token_file]
    assert any(p.parent.name == "logs" for p in searched) and any(p.name.startswith("env_") for p in searched)
    leaked = [p for p in searched if token.encode() in p.read_bytes()]
    assert not leaked, leaked


def test_flight_refuses_a_token_from_another_run(tmp_path: Path) -> None:
    ours, theirs = create_run_secret(tmp_path / "ours"), create_run_secret(tmp_path / "theirs")
    assert ours != theirs
    with RolloutFlightServer(token=ours, capacity=2) as server:
        location = f"grpc://127.0.0.1:{server.port}"
        with RolloutFlightClient(location, theirs, "intruder") as client, \
                pytest.raises(flight.FlightUnauthenticatedError):
            client.ping()
        with RolloutFlightClient(location, ours, "worker") as client:
            assert client.ping() >= 0
        assert server.stats()["received"] == 0


REWARD = "def score(prompt, response, ground_truth, **_):\n    return 1.0\n"


@pytest.mark.parametrize("how", ["group-writable", "world-writable", "owned by another user"])
def test_reward_file_others_could_change_is_refused(tmp_path: Path, how: str) -> None:
    reward = tmp_path / "reward.py"
    marker = tmp_path / "imported"
    reward.write_text(f"open({str(marker)!r}, 'w').close()\n" + REWARD)
    if how == "owned by another user":
        if os.getuid() != 0:
            pytest.skip("chown needs root")
        os.chown(reward, 65534, 65534)
    else:
        reward.chmod(0o664 if how == "group-writable" else 0o646)
    code, stderr = run_main(tmp_path, f"reward.function={reward}:score")
    assert code == 2 and stderr.count("\n") == 1, stderr
    assert "reward.function: reward file " in stderr and stderr.startswith("verl-hpc: error: ")
    assert not marker.exists()  # refused before a line of it ran


def test_reward_code_runs_only_from_the_configured_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module of the same name lying in the working directory is not what gets imported."""
    from verl_hpc.config.user_code import resolve_function

    chosen, decoy = tmp_path / "mine", tmp_path / "cwd"
    chosen.mkdir()
    decoy.mkdir()
    (chosen / "rewards.py").write_text("def score(prompt, response, ground_truth, **_):\n    return 2.0\n")
    (decoy / "rewards.py").write_text(f"open({str(tmp_path / 'decoy-ran')!r}, 'w').close()\n" + REWARD)
    monkeypatch.chdir(decoy)
    fn = resolve_function(f"{chosen / 'rewards.py'}:score", "reward.function")
    assert fn(prompt="", response="", ground_truth="") == 2.0
    assert not (tmp_path / "decoy-ran").exists()


def test_rendezvous_keys_are_out_of_reach_without_the_run_secret() -> None:
    """torch's TCPStore takes any client; ours keeps every key under a name only the secret derives."""
    from datetime import timedelta

    import torch.distributed as dist

    from verl_hpc.runtime.process.dist import secret_store
    from verl_hpc.runtime.process.env import JobEnvironment, free_port

    port = free_port()
    env = JobEnvironment.from_env({"VERL_HPC_RANK": "0", "VERL_HPC_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)})
    timeout = timedelta(seconds=2)
    ours = secret_store(env, "s3cret" * 8, timeout)
    ours.set("rank_0_address", "10.0.0.1:4242")
    stranger = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)  # the port is open to anyone
    assert stranger.num_keys() >= 1  # it reaches the server...
    assert not stranger.check(["rank_0_address"])  # ...but cannot name our key
    with pytest.raises(dist.DistStoreError):
        stranger.get("rank_0_address")
    wrong = secret_store(JobEnvironment.from_env({"VERL_HPC_RANK": "1", "VERL_HPC_WORLD_SIZE": "2",
                                                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}),
                         "guess" * 8, timeout)
    assert not wrong.check(["rank_0_address"])
    same = secret_store(JobEnvironment.from_env({"VERL_HPC_RANK": "1", "VERL_HPC_WORLD_SIZE": "2",
                                                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}),
                        "s3cret" * 8, timeout)
    assert same.get("rank_0_address") == b"10.0.0.1:4242"
