"""The weight sync's chain: every receiver gets the sender's weights bit for bit, and the
sender puts each byte on the wire once whatever the number of receivers (counted by the
kernel: `ss`'s per-socket bytes_sent), where the broadcast tree sends it ceil(log2(R + 1)) times."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl_hpc.models.tiny import PRESETS, build_model
from verl_hpc.transport.weights.chain import chain_links, relay_for
from verl_hpc.utils.proc import exit_now
from verl_hpc.utils.wire_count import tcp_bytes_sent

BUCKET = 1 << 20


def test_chain_links_and_each_ranks_place() -> None:
    assert chain_links(0, [3]) == []  # one receiver: the sync group already is the pair
    assert chain_links(0, [3, 4, 5]) == [[0, 3], [3, 4], [4, 5]]
    links = chain_links(0, [3, 4, 5])
    groups = ["g03", "g34", "g45"]
    leader, middle, last = relay_for(0, links, groups), relay_for(4, links, groups), relay_for(5, links, groups)
    assert leader is not None and (leader.up, leader.up_rank, leader.down) == (None, None, "g03")
    assert middle is not None and (middle.up, middle.up_rank, middle.down) == ("g34", 3, "g45")
    assert last is not None and (last.up, last.up_rank, last.down) == ("g45", 4, None)
    assert relay_for(1, links, groups) is None  # another trainer rank: not in the chain


def _model(seed: int) -> torch.nn.Module:
    spec = PRESETS["small"]
    return build_model(spec, spec.vocab_size, pad_id=0, eos_id=1, seed=seed)


def _rank(rank: int, world: int, chained: bool, out: str) -> None:
    from verl_hpc.transport.weights.bucketed import STOP_VERSION, broadcast_weights, receive_weights

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out, 'init')}", rank=rank,
                            world_size=world)
    try:
        links = chain_links(0, list(range(1, world)))
        relay = relay_for(rank, links, [dist.new_group(ranks=pair) for pair in links]) if chained else None
        model = _model(seed=0 if rank == 0 else 100 + rank)
        dist.barrier()
        before = tcp_bytes_sent(os.getpid())
        version, sent = broadcast_weights(model, dist.group.WORLD, 0, 7, rank == 0, BUCKET, relay=relay)
        dist.barrier()
        wire = tcp_bytes_sent(os.getpid()) - before
        if rank == 0:
            broadcast_weights(model, dist.group.WORLD, 0, STOP_VERSION, True, BUCKET, relay=relay)
        else:  # the stop reaches every link, with no data after it
            specs = [(n, p.shape) for n, p in model.named_parameters()]
            assert receive_weights(specs, dist.group.WORLD, 0, BUCKET, relay=relay)[0] == STOP_VERSION
        digest = [hashlib.sha256(p.detach().numpy().tobytes()).hexdigest() for p in model.parameters()]
        Path(out, f"rank{rank}.json").write_text(json.dumps({"version": version, "wire": wire, "digest": digest}))
    finally:
        dist.destroy_process_group()
    exit_now(0)  # done and written: no teardown abort (verl_hpc/utils/proc.py)


def _sync(tmp_path: Path, receivers: int, chained: bool) -> list[dict]:
    out = tmp_path / f"r{receivers}-{chained}"
    out.mkdir()
    mp.start_processes(_rank, args=(receivers + 1, chained, str(out)), nprocs=receivers + 1, join=True,
                       start_method="spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(receivers + 1)]


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to count bytes on the wire")
@pytest.mark.parametrize("receivers", [2, 3])
def test_the_chain_delivers_bit_for_bit_and_the_sender_sends_each_byte_once(tmp_path: Path,
                                                                          receivers: int) -> None:
    model_bytes = sum(p.numel() * 4 for p in _model(0).parameters())
    chained, tree = _sync(tmp_path, receivers, True), _sync(tmp_path, receivers, False)
    for ranks in (chained, tree):  # every receiver holds the sender's weights, bit for bit
        assert all(r["version"] == 7 and r["digest"] == ranks[0]["digest"] for r in ranks)
    # the chain: rank 0 sends the model once, each middle link once, the last one nothing
    assert model_bytes <= chained[0]["wire"] < 1.05 * model_bytes, (chained[0]["wire"], model_bytes)
    assert all(model_bytes <= r["wire"] < 1.05 * model_bytes for r in chained[1:-1])
    assert chained[-1]["wire"] < 0.05 * model_bytes
    # gloo's binomial tree: rank 0 sends it ceil(log2(R + 1)) = 2 times for 2 and 3 receivers
    assert tree[0]["wire"] >= 1.95 * model_bytes, (tree[0]["wire"], model_bytes)


def test_sum_for_pid_reads_ss_lines_of_that_process_only() -> None:
    from verl_hpc.utils.wire_count import sum_for_pid

    text = ('ESTAB 0 0 127.0.0.1:1 127.0.0.1:2 users:(("python",pid=42,fd=5))\n'
            '\t cubic bytes_sent:1000 bytes_acked:1000\n'
            'ESTAB 0 0 127.0.0.1:3 127.0.0.1:4 users:(("python",pid=7,fd=5),("python",pid=42,fd=9))\n'
            '\t cubic bytes_sent:24 bytes_received:5\n'
            'ESTAB 0 0 127.0.0.1:5 127.0.0.1:6 users:(("python",pid=421,fd=3))\n'
            '\t cubic bytes_sent:99999\n')
    assert sum_for_pid(text, 42) == 1024 and sum_for_pid(text, 7) == 24 and sum_for_pid(text, 1) == 0
