"""Data parallel: rank shards tile the global batch; 2 gloo processes under torchrun end with the
same weights as 1 process with the doubled batch."""

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import tiny_run_config
from safetensors.torch import load_file

from tinylm.data.prepare import prepare
from tinylm.data.tokens import Batches
from tinylm.training.distributed import DistContext, setup_distributed, shard_rows
from tinylm.training.trainer import accumulate_gradients, build_model, micro_batches, train

REPO = Path(__file__).resolve().parents[1]


def test_shard_rows_layout():
    # rank k at micro-step m takes rows (m * world + k) * B .. + B
    assert shard_rows(0, 0, 2, 4) == (0, 4)
    assert shard_rows(0, 1, 2, 4) == (4, 4)
    assert shard_rows(1, 0, 2, 4) == (8, 4)
    assert shard_rows(2, 1, 3, 5) == (35, 5)


@pytest.mark.parametrize("mode", ["packed", "stories"])
def test_rank_shards_tile_the_global_batch(tmp_path, stories_file, mode):
    cfg = tiny_run_config(tmp_path, stories_file)
    prepared = prepare(cfg, tmp_path)
    batches = Batches(prepared.splits["train"], 32, mode, seed=7)
    world, accum, B = 2, 3, 2
    ((big_x, big_y),) = micro_batches(batches, step=5, batch_size=world * accum * B, accum=1, dist=DistContext())
    parts = {}
    for rank in range(world):
        for m, (x, y) in enumerate(micro_batches(batches, 5, B, accum, DistContext(rank=rank, world_size=world))):
            parts[m * world + rank] = (x, y)
    x = torch.cat([parts[i][0] for i in range(world * accum)])
    y = torch.cat([parts[i][1] for i in range(world * accum)])
    assert torch.equal(x, big_x) and torch.equal(y, big_y)
    assert not torch.equal(parts[0][0], parts[1][0])  # ranks really read different rows


def test_single_process_needs_no_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dist = setup_distributed("cpu")
    assert (dist.world_size, dist.rank, dist.enabled) == (1, 0, False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WORKER = textwrap.dedent("""
    import sys
    import torch
    from safetensors.torch import save_file
    from tinylm.config import config_from_dict, load_config_file
    from tinylm.data.prepare import prepare
    from tinylm.data.tokens import Batches
    from tinylm.training import distributed
    from tinylm.training.trainer import accumulate_gradients, build_model, micro_batches, train

    cfg = config_from_dict(load_config_file(sys.argv[1]))
    prepared = prepare(cfg, sys.argv[2])  # reuses the cache the test wrote
    dist = distributed.setup_distributed("cpu")
    # 1) the synchronised gradient of one step (2 micro-batches per rank), saved by rank 0
    torch.manual_seed(0)
    model = build_model(cfg, prepared.tokenizer.vocab_size)
    ddp = distributed.wrap_ddp(model, dist, torch.device("cpu"))
    syncs = []

    def counting_allreduce(state, bucket):  # counts DDP's gradient all-reduces
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        syncs.append(1)
        return allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, counting_allreduce)
    batches = Batches(prepared.splits["train"], cfg.model.context_length, cfg.data.batching, seed=cfg.train.seed)
    micro = micro_batches(batches, 0, 2, 2, dist)
    loss, n = accumulate_gradients(ddp, micro, torch.device("cpu"), dist=dist, ddp_model=ddp)
    syncs_two_micro = len(syncs)
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    accumulate_gradients(ddp, micro[:1], torch.device("cpu"), dist=dist, ddp_model=ddp)
    syncs_one_micro = len(syncs) - syncs_two_micro
    if dist.is_main:
        save_file({**grads, "loss": torch.tensor([loss], dtype=torch.float64),
                   "syncs": torch.tensor([syncs_two_micro, syncs_one_micro])}, sys.argv[3] + ".grads")
    # 2) a whole training run through train()
    train(cfg, prepared, sys.argv[3])
    distributed.cleanup(dist)
""")


@pytest.mark.slow
def test_two_gloo_processes_equal_one_process_with_doubled_batch(tmp_path, stories_file):
    cfg = tiny_run_config(
        tmp_path / "prep", stories_file, max_steps=3, eval_interval=3, threads=1, global_batch_size=8, lr=3e-3
    )
    cfg.data.batching = "stories"  # rows with different token counts: the global token weighting matters
    prepared = prepare(cfg, tmp_path / "prep")
    cfg_path = tmp_path / "cfg.yaml"
    cfg.save(cfg_path)
    (tmp_path / "worker.py").write_text(WORKER)

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        str(tmp_path / "worker.py"),
        str(cfg_path),
        str(tmp_path / "prep"),
        str(tmp_path / "ddp"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]

    train(cfg, prepared, tmp_path / "single")  # one process, global batch 8
    # the gradient: 2 ranks x 2 micro-batches of 2 == 1 process, 1 micro-batch of 8
    torch.manual_seed(0)
    model = build_model(cfg, prepared.tokenizer.vocab_size)
    batches = Batches(prepared.splits["train"], cfg.model.context_length, "stories", seed=cfg.train.seed)
    loss, _ = accumulate_gradients(model, micro_batches(batches, 0, 8, 1, DistContext()), torch.device("cpu"))
    ddp_grads = load_file(str(tmp_path / "ddp.grads"))
    assert ddp_grads.pop("loss").item() == pytest.approx(loss, abs=1e-6)
    two_micro, one_micro = ddp_grads.pop("syncs").tolist()
    assert two_micro == one_micro >= 1  # no all-reduce on the first (non-final) micro-batch
    for name, p in model.named_parameters():
        torch.testing.assert_close(ddp_grads[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)
    ddp = load_file(str(tmp_path / "ddp/checkpoints/last/model.safetensors"))
    single = load_file(str(tmp_path / "single/checkpoints/last/model.safetensors"))
    initial = load_file(str(tmp_path / "single/checkpoints/best/model.safetensors"))
    for name, w in single.items():
        torch.testing.assert_close(ddp[name], w, rtol=0, atol=1e-5, msg=name)
    # only rank 0 logged: one header and one row per step
    rows = (tmp_path / "ddp/metrics.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 1  # log_interval 10 > 3 steps: only the final evaluation row
    single_rows = (tmp_path / "single/metrics.csv").read_text().strip().splitlines()
    for column in (3, 4):  # train_loss, val_loss: ranks score their rows of the same batches
        assert float(rows[1].split(",")[column]) == pytest.approx(float(single_rows[1].split(",")[column]), abs=1e-5)
    assert initial  # best checkpoint written by rank 0
