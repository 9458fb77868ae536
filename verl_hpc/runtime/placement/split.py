"""Split: the rollout group generates on devices of its own; rollouts reach the trainers over Arrow Flight.

Why this shape: rollout ranks generate slices of the step's prompt groups and put them to
trainer rank 0's Flight server; rank 0 files them by step (with `max_staleness: k` the
rollout runs k steps ahead, and batches not yet trained on are part of the checkpoint),
hands every trainer rank its rows, and after the update broadcasts the actor's weights to
the rollout group in buckets. Each rollout is stamped with the policy version it came from.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verl_hpc.data.layout import even_slices
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.roles.weight_sync import (
    STOP_VERSION,
    broadcast_weights,
    engine_buffer,
    gather_only,
    push_weights,
    receive_weights,
)
from verl_hpc.runtime import validation
from verl_hpc.runtime.placement.base import Timer, generate_rows
from verl_hpc.runtime.placement.distributed import DistributedPlacement
from verl_hpc.runtime.step_metrics import sync_metrics
from verl_hpc.utils.logging import get_logger

log = get_logger("placement")
BUFFER_FILE = "rollout_buffer.arrow"  # rollouts generated ahead (max_staleness > 0), Arrow IPC


ROUND_STRIDE = 1 << 40  # dynamic sampling: round r of step s is filed as s + r * ROUND_STRIDE


def round_key(step: int, round_: int) -> int:
    """The `step` stamped on the rows of a step's generation round (round 0: the step itself)."""
    return step + round_ * ROUND_STRIDE


def val_key(trained: int) -> int:
    """The `step` stamped on validation rows after step `trained` (negative: never a training step)."""
    return -1 - trained


class _BufferedSteps:
    """How many steps of rollouts a checkpoint carries (run_state.json's `buffered_steps`)."""

    def __init__(self, owner: Split):
        self.owner = owner

    def state_dict(self) -> int:
        return self.owner.buffered_for_save

    def load_state_dict(self, value: int) -> None:
        """Applied in `after_resume`, which every rank runs (serving ranks have no checkpointer)."""


class Split(DistributedPlacement):
    name = "split"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.pending: dict[int, list[RolloutBatch]] = {}  # leader: rollouts filed by step
        self.resume_step = 0
        self.buffered_steps = 0      # after a resume: steps whose rollouts came from the checkpoint
        self.buffered_for_save = 0
        self.flight_server: Any = None
        self.flight_client: Any = None
        self.sent_bytes = 0    # rollout rank: the Arrow bytes of this step's batch, for serve_metrics
        self.sent_version = 0  # ... and the policy version that sampled it
        self.connect()

    def connect(self) -> None:
        """Trainer rank 0 serves Flight; the rollout ranks learn its address and connect."""
        from verl_hpc.data.transport import RolloutFlightClient, RolloutFlightServer, read_run_secret

        ctx = self.ctx
        token = read_run_secret(self.run_dir)
        location: Any = None
        if ctx.env.rank == self.leader:
            host = ctx.env.master_addr
            self.flight_server = RolloutFlightServer(f"grpc://{host}:0", token=token, capacity=8)
            location = f"grpc://{host}:{self.flight_server.port}"
        location = self.share_from_leader(location)
        if ctx.is_role("rollout"):
            self.flight_client = RolloutFlightClient(location, token=token, producer_id=f"rollout{ctx.rank_in_group}")

    # --- trainer side ------------------------------------------------------------------------------
    def rollouts(self, step: int, indices: list[int], policy_version: int, timer: Timer,
                 round_: int = 0) -> RolloutBatch | None:
        with timer("wait_rollout"):
            payload: list[Any] = [None]
            if self.is_leader:
                full = RolloutBatch.concat(self.receive_rollouts(round_key(step, round_))).sorted_by_row()
                self.check_staleness(full, policy_version, step)
                payload = [full.to_ipc()]
            if self.world > 1:
                dist.broadcast_object_list(payload, src=self.leader, group=self.ctx.process_group)
            batch = RolloutBatch.from_ipc(payload[0]).take(self.rows())
        return self.score(batch, timer)

    def receive_rollouts(self, step: int) -> list[RolloutBatch]:
        """This step's batches (every rollout rank's part), or an error naming who did not deliver."""
        while self.rows_pending(step) < self.cfg.trainer.batch_size:
            self.pull_rollout(step)
        return self.pending.pop(step)

    def rows_pending(self, step: int) -> int:
        return sum(len(b) for b in self.pending.get(step, []))

    def pull_rollout(self, step: int) -> None:
        ctx = self.ctx
        try:
            batch = self.flight_server.get(timeout=ctx.timeout_seconds)
        except TimeoutError:
            ranks = ctx.plan.group_ranks(ctx.plan.group_of_role("rollout").name)
            raise TimeoutError(
                f"step {step}: got {self.rows_pending(step)} of {self.cfg.trainer.batch_size} rollouts "
                f"within timeout_seconds={ctx.timeout_seconds:g}; rollout rank(s) {ranks} did not deliver "
                "(hint: see logs/rollout_rank*.out)") from None
        self.pending.setdefault(int(batch.column("step")[0].as_py()), []).append(batch)

    def check_staleness(self, batch: RolloutBatch, policy_version: int, step: int) -> None:
        lag = policy_version - min(batch.column("policy_version").to_pylist())
        if lag > self.cfg.algorithm.max_staleness:
            raise RuntimeError(f"step {step}: a rollout is {lag} policy versions old, above "
                               f"algorithm.max_staleness={self.cfg.algorithm.max_staleness}")


    def sync_weights(self, version: int, changed: bool) -> int:
        """Every step (the rollout ranks expect it) until the rollout has generated its last batch;
        after that only for a step that is validated (`validation_tail`)."""
        if self.trainer_step > self.last_needed() and not validation.due(self.cfg, self.trainer_step):
            return 0
        return self.send_split(version)

    def request_round(self, more: bool) -> None:
        group = self.ctx.sync_groups.get("rollout")
        if group is not None:  # the leader: the rollout ranks wait for the verdict
            verdict = torch.tensor([int(more)], dtype=torch.int64, device=self.roles.device)
            dist.broadcast(verdict, src=self.leader, group=group)

    def last_needed(self) -> int:
        """The last step whose weights the rollout needs for training rollouts."""
        return self.cfg.trainer.total_steps - self.cfg.algorithm.max_staleness - 1

    def validation_rollouts(self, step: int, policy_version: int) -> RolloutBatch:
        """The rollout group generated them with this step's weights; the leader hands out slices."""
        payload: list[Any] = [None]
        if self.is_leader:
            key = val_key(step)
            expected = len(self.roles.val_prompt_ids or []) * self.cfg.trainer.val_n
            while self.rows_pending(key) < expected:
                self.pull_rollout(key)
            payload = [RolloutBatch.concat(self.pending.pop(key, [])).sorted_by_row().to_ipc()]
        if self.world > 1:
            dist.broadcast_object_list(payload, src=self.leader, group=self.ctx.process_group)
        full = RolloutBatch.from_ipc(payload[0])
        start, end = even_slices(len(full), self.world, self.rank)
        return full.take(list(range(start, end)))

    def send_split(self, version: int) -> int:
        group = self.ctx.sync_groups.get("rollout")
        if group is None:  # not the leader: only join the FSDP gathers the leader's send needs
            gather_only(self.roles.actor.model)  # type: ignore[union-attr]
            return 0
        return broadcast_weights(self.roles.actor.model, group, self.leader, version, True)[1]  # type: ignore[union-attr]

    def resume_weights(self, version: int) -> None:
        if self.trains:
            self.send_split(version)
        elif self.ctx.is_role("rollout"):
            self.receive_split()

    def resize_margin(self) -> int:
        return self.cfg.algorithm.max_staleness + 2

    # --- checkpointed rollouts (max_staleness > 0) --------------------------------------------------
    def extra_states(self) -> dict[str, Any]:
        return {**super().extra_states(), "buffered_steps": _BufferedSteps(self)}

    def extra_files(self, step: int) -> dict[str, bytes] | None:
        """Leader: the rollouts already generated for the next steps (sampled from weights that are gone)."""
        self.buffered_for_save = 0
        last = min(step + self.cfg.algorithm.max_staleness, self.cfg.trainer.total_steps)
        if not self.is_leader or last <= step:
            return None
        for future in range(step + 1, last + 1):
            while self.rows_pending(future) < self.cfg.trainer.batch_size:
                self.pull_rollout(future)
        batches = [b for s in range(step + 1, last + 1) for b in self.pending[s]]
        self.buffered_for_save = last - step
        return {BUFFER_FILE: RolloutBatch.concat(batches).to_ipc()}

    def after_resume(self, path: Path, run: dict[str, Any], read_shared: Any = None) -> None:
        self.resume_step = int(run["step"])
        self.buffered_steps = int(run.get("buffered_steps") or 0)
        if self.is_leader and self.buffered_steps:
            batch = RolloutBatch.from_ipc(read_shared(path, BUFFER_FILE))
            steps = batch.column("step").to_numpy()
            for s in sorted(set(steps.tolist())):
                self.pending[int(s)] = [batch.take((steps == s).nonzero()[0])]

    # --- rollout side --------------------------------------------------------------------------------
    def serve(self, step: int, indices: list[int], timer: Timer) -> bool:
        if not self.ctx.is_role("rollout"):
            return super().serve(step, indices, timer)
        self.heartbeat.enter(f"step {step} rollout")
        if not self.serve_rollout(step, indices, timer):
            return False
        return step < self.cfg.trainer.total_steps or self.validation_tail()

    def serve_rollout(self, step: int, indices: list[int], timer: Timer) -> bool:
        lag = self.cfg.algorithm.max_staleness
        if step <= self.resume_step + self.buffered_steps:
            return True  # this step's rollouts were restored from the checkpoint
        if step > self.resume_step + lag + 1:
            with timer("update_weights"):
                if self.receive_split() == STOP_VERSION:
                    return False
            self.put_validation(step - lag - 1)  # these weights are trainer step (step - lag - 1)'s
        elif step == 1:
            self.put_validation(0)
        n = self.cfg.algorithm.sampling.n
        start, end = even_slices(len(indices), self.ctx.group.size, self.ctx.rank_in_group)
        rows = [g * n + j for g in range(start, end) for j in range(n)]
        with timer("gen"):
            batch = generate_rows(self.roles, self.cfg, step, indices, rows, self.roles.engine.policy_version)  # type: ignore[union-attr]
        with timer("send"):
            try:
                self.flight_client.put(batch)
            except Exception:  # the trainer shut its server down: a stop
                return False
        self.sent_bytes = batch.record_batch.nbytes
        self.sent_version = self.roles.engine.policy_version  # type: ignore[union-attr]
        return not self.cfg.algorithm.filter_groups.enable or self.serve_rounds(step, rows)

    def serve_metrics(self, timer: Timer) -> dict[str, float]:
        """The rollout rank's view: generation and send seconds, the weights it received, the
        rollout bytes it sent (and at what rate), and which policy version sampled them."""
        out = super().serve_metrics(timer)
        if not self.ctx.is_role("rollout"):
            return out
        out.update(sync_metrics(self.last_sync_bytes, timer.seconds.get("timing_s/update_weights", 0.0)))
        send_s = timer.seconds.get("timing_s/send", 0.0)
        out["perf/rollout_transport_bytes"] = float(self.sent_bytes)
        out["perf/rollout_transport_gbps"] = self.sent_bytes / send_s / 1e9 if self.sent_bytes and send_s > 0 else 0.0
        if self.sent_bytes:  # a step restored from the checkpoint sent nothing
            out["rollout/policy_version"] = float(self.sent_version)
        self.sent_bytes = 0
        return out

    def serve_rounds(self, step: int, rows: list[int]) -> bool:
        """Dynamic sampling: another round of new prompts as long as the leader asks for one."""
        group = self.ctx.sync_groups["rollout"]
        round_ = 0
        while True:
            verdict = torch.zeros(1, dtype=torch.int64, device=self.roles.device)
            dist.broadcast(verdict, src=self.leader, group=group)
            if not int(verdict.item()):
                return True
            round_ += 1
            indices = self.sampler.next_indices()
            batch = generate_rows(self.roles, self.cfg, round_key(step, round_), indices, rows,
                                  self.roles.engine.policy_version)  # type: ignore[union-attr]
            try:
                self.flight_client.put(batch)
            except Exception:  # the trainer shut its server down: a stop
                return False

    def validation_tail(self) -> bool:
        """After its last training batch: the weights of each later validated step, validated."""
        first = max(self.last_needed() + 1, self.resume_step + 1)
        for trained in range(first, self.cfg.trainer.total_steps + 1):
            if validation.due(self.cfg, trained):
                if self.receive_split() == STOP_VERSION:
                    return False
                self.put_validation(trained)
        return True

    def put_validation(self, trained: int) -> None:
        """Rollout ranks: their slice of the validation prompts, if `trained` is a validated step."""
        if not validation.due(self.cfg, trained):
            return
        self.heartbeat.enter(f"step {trained} validation")
        total = len(self.roles.val_prompt_ids or [])
        start, end = even_slices(total, self.ctx.group.size, self.ctx.rank_in_group)
        batch = validation.validation_rows(self.roles, self.cfg, start, end,
                                           self.roles.engine.policy_version, val_key(trained))  # type: ignore[union-attr]
        if len(batch):
            try:
                self.flight_client.put(batch)
            except Exception:  # the trainer shut its server down: a stop, seen at the next receive
                log.info("validation rows for step %d not delivered: the trainer stopped", trained)

    def receive_split(self) -> int:
        """The newest weights into the engine; returns their version (STOP_VERSION: stop)."""
        engine = self.roles.engine
        version, tensors = receive_weights(engine.weight_specs(), self.ctx.sync_groups["rollout"], self.leader,  # type: ignore[union-attr]
                                           device=self.roles.device, into=engine_buffer(engine))
        if version != STOP_VERSION:
            self.last_sync_bytes = push_weights(tensors, engine, version)
            engine.policy_version = version  # type: ignore[union-attr]
        return version

    def stop_services(self) -> None:
        """Best effort: tell the rollout (and remote role) ranks to stop, never waiting long on them."""
        super().stop_services()
        if not self.is_leader or "rollout" not in self.ctx.sync_groups:
            return
        if self.cfg.algorithm.max_staleness > 0 and self.flight_server is not None:
            self.flight_server.shutdown()  # unblocks a rollout waiting on a full buffer
        header = torch.tensor([STOP_VERSION, 0, 0], dtype=torch.int64, device=self.roles.device)
        work = dist.broadcast(header, src=self.ctx.env.rank, group=self.ctx.sync_groups["rollout"], async_op=True)
        try:
            work.wait(timeout=timedelta(seconds=5))
        except RuntimeError as err:
            log.warning("rollout ranks did not take the stop message: %s", err)

    def close(self) -> None:
        super().close()
        if self.flight_client is not None:
            self.flight_client.close()
        if self.flight_server is not None:
            self.flight_server.shutdown()
