"""The producer's stages for the throughput plan (common/throughput_plan.py): one target forward per batch on a
TP rank, and the hand-off of its features to the drafters.

The shapes are the memory plan's (producer/memory_plan.py): the decoder cut after its last captured layer,
sharded as transformers' TP plan gives each rank, built on the meta device; common/flop_model.py reads each
layer's matmul weights off that module. A TP group all-reduces the residual stream twice a layer (after the
attention or linear attention, after the MLP).

    python -m producer throughput-plan JOB [--target-config DIR] [--sample-tokens N]     one JSON line a stage
"""

from __future__ import annotations

import torch
from transformers import AutoModel, PretrainedConfig

from common.config import JobConfig
from common.flop_model import expert_counts, ring_allreduce_bytes, target_forward_flops, target_layer_shapes
from common.role_plans import plan_command
from common.throughput_plan import Work
from producer.memory_plan import DTYPES, captured_cut, rank_shard, read_config


def target_work(job: JobConfig, text: PretrainedConfig, sample_tokens: int) -> list[Work]:
    t, tokens = job.target, job.data.tokens_per_batch
    cut = captured_cut(text, t.layer_ids, t.num_features)
    shard = rank_shard(cut, t.tp_size, t.ep_size)
    with torch.device("meta"):
        model = AutoModel.from_config(shard, dtype=DTYPES[t.dtype])
    experts, top_k = expert_counts(text)
    layers = target_layer_shapes(model, shard, top_k / experts if experts else None)
    itemsize = torch.empty((), dtype=DTYPES[t.dtype]).element_size()
    parts = {"forward": ("flops", target_forward_flops(layers, tokens, sample_tokens))}
    if t.tp_size > 1:
        residual = tokens * int(text.hidden_size) * itemsize
        parts["TP all-reduce"] = ("nvlink", 2 * len(layers) * ring_allreduce_bytes(residual, t.tp_size))
    forward = Work(
        "target forward",
        t.replicas,
        parts,
        f"{len(layers)} layers of the cut model, TP {t.tp_size}, {t.replicas} replica(s)",
    )
    width = (len(t.layer_ids) if t.layer_ids else t.num_features) * int(text.hidden_size)
    features = tokens * width * itemsize
    ring_devices = {t.devices_of(r)[0] for r in range(t.replicas)}
    handoff: dict[str, tuple[str, float]] = {}
    if job.transport_kind == "cuda":  # each batch to one replica of every drafter, read from the ring's GPU
        remote = sum(any(d.device_of(r) not in ring_devices for r in range(d.replicas)) for d in job.drafters)
        local = len(job.drafters) - remote
        if remote:
            handoff["to drafter GPUs"] = ("nvlink", remote * features)
        if local:
            handoff["on the ring's GPU"] = ("hbm", 2 * local * features)  # read and write
    else:  # a host ring: the write down, each consumer's copy up on its own GPU's link
        handoff = {"ring write": ("pcie", features), "copy-in": ("pcie", features)}
    note = f"{features / 1e6:,.0f} MB of features a batch to {len(job.drafters)} drafter(s)"
    return [forward, Work("hand-off", t.replicas, handoff, note)]


DESCRIPTION = "the target forward's and the hand-off's work per batch (common/throughput_plan.py)"


def main(argv: list[str]) -> int:
    """`python -m producer throughput-plan JOB [--target-config DIR] [--sample-tokens N]`: a JSON line a stage."""
    return plan_command("producer", "throughput-plan", argv, DESCRIPTION, read_config, work=target_work)
