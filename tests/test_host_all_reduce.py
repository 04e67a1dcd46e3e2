"""The shared-memory all-reduce of tensor-parallel ranks on one host: the sum of every rank's
tensor, the same bits on every rank, gloo for what does not fit (three processes, one thread
each)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fluidserve.net import free_port

WORLD = 3
SLOT = 64 * 1024  # bytes: the 64 x 512 float32 case takes gloo


def tensor(rank: int, shape: tuple[int, ...], dtype: torch.dtype, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(shape, generator=g).to(dtype)


CASES = [((1, 256), torch.bfloat16), ((7, 512), torch.float32), ((32, 256), torch.bfloat16),
         ((64, 512), torch.float32), ((3, 100), torch.bfloat16), ((1, 256), torch.bfloat16)]


def rank_main(rank: int, port: int, out_dir: str) -> None:
    from fluidserve.model.host_all_reduce import HostAllReduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    group = dist.new_group(list(range(WORLD)))
    host = HostAllReduce.create(group, slot_bytes=SLOT)
    results = []
    for step in range(3):  # (each case twice and more: both buffers of every slot reused)
        for i, (shape, dtype) in enumerate(CASES):
            x = tensor(rank, shape, dtype, step * len(CASES) + i)
            if i == 2:  # not contiguous: gloo
                x = x.t()
            results.append(host.all_reduce(x).clone())
    torch.save({"results": results, "seq": host.seq}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def test_every_rank_gets_the_same_sum_in_rank_order(tmp_path):
    mp.spawn(rank_main, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    got = [torch.load(tmp_path / f"{r}.pt") for r in range(WORLD)]
    # Through shared memory: all but the non-contiguous and the larger-than-a-slot cases
    assert got[0]["seq"] == 3 * (len(CASES) - 2)
    k = 0
    for step in range(3):
        for i, (shape, dtype) in enumerate(CASES):
            parts = [tensor(r, shape, dtype, step * len(CASES) + i) for r in range(WORLD)]
            want = parts[0] + parts[1]
            for p in parts[2:]:
                want += p
            if i == 2:
                want = want.t()
            first = got[0]["results"][k]
            for r in range(1, WORLD):
                assert torch.equal(got[r]["results"][k], first), (step, i, r)
            if i in (2, 3):  # not contiguous, larger than a slot: gloo, which sums its own way
                tol = 1e-5 if dtype == torch.float32 else 1e-2
                assert torch.allclose(first.float(), want.float(), atol=tol, rtol=tol), (step, i)
            else:  # in rank order, rounded as the sum in rank order is
                assert torch.equal(first, want), (step, i)
            k += 1


def test_ranks_on_other_hosts_or_cpus_without_ordered_stores_take_gloo(monkeypatch):
    from fluidserve.model import host_all_reduce
    from fluidserve.model.host_all_reduce import HostAllReduce, host_identity

    monkeypatch.setattr(dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group: 0)
    where = ["elsewhere"]

    def gather(out, obj, group):  # the other rank's host
        out[0], out[1] = obj, (where[0], obj[1])

    monkeypatch.setattr(dist, "all_gather_object", gather)
    assert HostAllReduce.create(object()) is None
    # On this host, but a CPU that may reorder stores (an Arm server): gloo, before any
    # mapping is made
    where[0] = host_identity()[0]
    monkeypatch.setattr(host_all_reduce, "STORES_IN_ORDER", False)
    monkeypatch.setattr(host_all_reduce, "_new_mapping_file", None)  # (not called)
    assert HostAllReduce.create(object()) is None
