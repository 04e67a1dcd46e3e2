"""TetriInfer at GPU scale: the cluster's own code against the simulator's cost models.

Every instance gets its own cost-model executor (an instance has the parallel config's
TP x PP GPUs) and virtual clock; the KV transfer takes ``latency + bytes / bandwidth`` per
GPU of the instance (TP and PP shards move in parallel over their own links), with the
bandwidth from ``--kv-transfer-bandwidth-gbps`` or, by default, the device's measured
send/recv bandwidth (``profiles/network``, the largest message measured).
"""

from __future__ import annotations

import csv

from fluidserve.bench.records import RequestRecord
from fluidserve.bench.workload import WorkloadRequest
from fluidserve.config import EngineConfig, SimConfig
from fluidserve.data import data_dir
from fluidserve.disagg.cluster import Cluster, ClusterResult
from fluidserve.engine.messages import AddRequest
from fluidserve.sampling_params import SamplingParams
from fluidserve.sim.shapes import DEVICES, SHAPES


def send_recv_bandwidth_gbps(device: str, same_node: bool = True) -> float:
    """Point-to-point bandwidth between two GPUs of ``device`` (GB/s), from the profile's
    largest send/recv between GPUs on one node (NVLink: ~286 GB/s on A100s) or, with
    ``same_node=False``, on two nodes (~2.5 GB/s in the A100 profile). CPU simulation: this
    machine's copy speed is not modelled, so the A100 figure stands in."""
    root = data_dir()
    dev = DEVICES.get(device, DEVICES["a100"])
    for folder in (dev.network["pairwise"], DEVICES["a100"].network["pairwise"]):
        path = None if root is None else root / "profiles" / "network" / folder / "send_recv.csv"
        if path is not None and path.is_file():
            with open(path) as f:
                rows = [r for r in csv.DictReader(f) if int(r["num_workers"]) == 2
                        and (int(r["devices_per_node"]) > 1) == same_node]
            big = max(rows, key=lambda r: int(r["size"]))
            return int(big["size"]) / (float(big["time_stats.send_recv.median"]) / 1e3) / 1e9
    raise ValueError("no send/recv profile: pass --kv-transfer-bandwidth-gbps")


def simulate_disaggregated(work: list[WorkloadRequest], eng: EngineConfig, sim: SimConfig,
                           seed: int = 0, jitter_seed: int | None = None
                           ) -> tuple[list[RequestRecord], ClusterResult]:
    from fluidserve.sim.run import make_cost_model, make_executor
    from fluidserve.sim.simulate import _record

    par = eng.parallel

    def executor(clock):
        ex = make_executor(sim, eng, make_cost_model(sim, par))
        ex.cost.reseed(seed if jitter_seed is None else jitter_seed)
        ex.clock = clock
        return ex

    if sim.cost_model == "gpu":
        kv = SHAPES[sim.model_shape].kv_bytes_per_token(2, par.tensor_parallel_size,
                                                       par.pipeline_parallel_size)
    else:
        from fluidserve.model.arch import kv_bytes_per_token
        from fluidserve.model.builder import SHAPES as MODEL_SHAPES

        m = MODEL_SHAPES["250m"]
        kv = kv_bytes_per_token(m.num_layers, m.num_kv_heads, m.hidden_size // m.num_heads, 2,
                                pp=par.pipeline_parallel_size)
    bw = eng.disagg.kv_transfer_bandwidth_gbps or send_recv_bandwidth_gbps(sim.device)
    cluster = Cluster(eng, executor, kv, bandwidth_gbps=bw, seed=seed,
                      max_tokens_are_lengths=True)
    arrivals = [(w.arrival, AddRequest(str(w.index), [1] * w.prompt_len,
                                       SamplingParams(max_tokens=w.output_len, ignore_eos=True,
                                                      temperature=0.0)), w.output_len)
                for w in work]
    res = cluster.run(arrivals)
    records = [_record(w, res.requests[str(w.index)]) for w in work]
    return records, res


def cluster_summary(res: ClusterResult, eng: EngineConfig, bandwidth_gbps: float | None = None
                    ) -> dict:
    d = eng.disagg
    return {
        "disaggregated": True,
        "prefill_instances": d.num_prefill_instances,
        "decode_instances": d.num_decode_instances,
        "prefill_chunk_size": d.prefill_chunk_size,
        "prefill_policy": d.prefill_policy,
        "length_predictor": d.length_predictor,
        "dispatcher": d.dispatcher,
        "decode_admission": d.decode_admission,
        "kv_transfer_granularity": d.kv_transfer_granularity,
        "kv_transfers": res.transfers,
        "kv_transfer_seconds": res.transfer_seconds,
        "instance_seconds": res.instance_seconds,
        "instance_busy_fraction": [i.busy / res.makespan if res.makespan else 0.0
                                   for i in res.instances],
        "final_roles": [i.role for i in res.instances],
        "flips": [{"time": f.time, "instance": f.instance, "to": f.to} for f in res.flips],
    }
