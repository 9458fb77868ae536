"""Trainer rank 0's intake of rollouts from a split rollout group, filed by step.

Why a mixin of its own: with `max_staleness` > 0 batches for later steps arrive early and
wait here, and the ones not yet trained on are part of the checkpoint (an off-policy run
resumes exactly only if they are restored); this is that bookkeeping, apart from the loop.
Mixed into DistributedTrainer; uses its cfg, ctx, roles, step, pending and split.
"""

from __future__ import annotations

from verl_hpc.data.rollout_batch import RolloutBatch


class RolloutIntake:
    def receive_rollouts(self) -> list[RolloutBatch]:
        """This step's batches (every rollout rank's part), or an error naming who did not deliver.

        Batches are filed by their `step` column: with `max_staleness` > 0 a fast rollout rank
        may deliver later steps before a slow one delivers this one.
        """
        while self.rows_pending(self.step) < self.cfg.trainer.batch_size:
            self.pull_rollout()
        return self.pending.pop(self.step)

    def rows_pending(self, step: int) -> int:
        return sum(len(b) for b in self.pending.get(step, []))

    def pull_rollout(self) -> None:
        roles, ctx = self.roles, self.ctx
        try:
            batch = roles.flight_server.get(timeout=ctx.timeout_seconds)
        except TimeoutError:
            ranks = ctx.plan.group_ranks(ctx.plan.group_of_role("rollout").name)
            raise TimeoutError(
                f"step {self.step}: got {self.rows_pending(self.step)} of {self.cfg.trainer.batch_size} rollouts "
                f"within timeout_seconds={ctx.timeout_seconds:g}; rollout rank(s) {ranks} did not deliver "
                "(hint: see logs/rollout_rank*.out)") from None
        self.pending.setdefault(int(batch.column("step")[0].as_py()), []).append(batch)

    def buffered_rollouts(self) -> tuple[int, bytes | None]:
        """Leader, max_staleness > 0: the rollouts already generated for the next steps, as Arrow IPC.

        They were sampled from older weights that no longer exist; saving them is what makes
        an off-policy run resume exactly.
        """
        last = min(self.step + self.cfg.algorithm.max_staleness, self.cfg.trainer.total_steps)
        if not self.split or last <= self.step:
            return 0, None
        for future in range(self.step + 1, last + 1):
            while self.rows_pending(future) < self.cfg.trainer.batch_size:
                self.pull_rollout()
        batches = [b for s in range(self.step + 1, last + 1) for b in self.pending[s]]
        return last - self.step, RolloutBatch.concat(batches).to_ipc()

    def load_buffered_rollouts(self, data: bytes) -> None:
        batch = RolloutBatch.from_ipc(data)
        steps = batch.column("step").to_numpy()
        for s in sorted(set(steps.tolist())):
            self.pending[int(s)] = [batch.take((steps == s).nonzero()[0])]
