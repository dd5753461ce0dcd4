"""Two workers with one global batch of masked rows: :func:`global_share` makes DDP's
average of their losses (and gradients) the masked mean over the whole batch, as one
worker computes it (gloo process group on 127.0.0.1, two processes)."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from speclab.pipelines.fit import global_share


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (x * m).sum() / m.sum().clamp_min(1.0)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(8, 5, generator=g, dtype=torch.float64)
    m = torch.zeros(8, 5, dtype=torch.float64)
    m[:2] = 1.0  # rank 0's rows are mostly scored, rank 1's barely
    m[4, 0] = 1.0
    return x, m


def _worker(rank: int, port: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        x, m = _data()
        xs, ms = x[rank * 4:(rank + 1) * 4], m[rank * 4:(rank + 1) * 4]
        w = torch.ones((), dtype=torch.float64, requires_grad=True)
        loss = global_share(_masked_mean(w * xs, ms), float(ms.sum()), 2)
        loss.backward()
        t = torch.stack([loss.detach(), w.grad.detach()])
        dist.all_reduce(t)  # DDP's mean over workers
        out[rank] = (t / 2).tolist()
    finally:
        dist.destroy_process_group()


def test_two_workers_give_the_global_masked_mean():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(port, out), nprocs=2, join=True)
    x, m = _data()
    want = float(_masked_mean(x, m))
    for rank in (0, 1):
        loss, grad = out[rank]
        assert abs(loss - want) < 1e-12 and abs(grad - want) < 1e-12
    # the plain mean of the two workers' masked means is not it (the bias this removes)
    naive = (float(_masked_mean(x[:4], m[:4])) + float(_masked_mean(x[4:], m[4:]))) / 2
    assert abs(naive - want) > 1e-3


def test_one_worker_or_no_mask_is_unchanged():
    loss = torch.tensor(0.7)
    assert global_share(loss, 3.0, 1) is loss
    assert global_share(loss, None, 4) is loss
