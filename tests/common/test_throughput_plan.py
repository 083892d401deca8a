"""The throughput plan (common/flop_model.py, common/throughput_plan.py, the roles' throughput-plan commands):
FLOP counts against hand computations, the model against a measured CPU step, and the dry run's section."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, Qwen3Config, Qwen3MoeConfig

from bench.harness import write_job
from common.config import DrafterConfig, load_job
from common.flop_model import (
    ELEMENTWISE_BYTES_PER_PARAM,
    DrafterBatch,
    anchor_context_keys,
    batch_anchors,
    drafter_flops,
    newton_schulz_flops,
    target_forward_flops,
    target_layer_shapes,
    visible_keys,
)
from common.throughput_plan import DEVICES, REFERENCES, Work, infer_device, optimizer_line, rates, render
from consumer.model import DrafterArch
from consumer.throughput_plan import drafter_shapes, muon_split, trained_matrices
from producer.throughput_plan import target_work

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def meta_model(config):
    with torch.device("meta"):
        return AutoModel.from_config(config)


def test_visible_keys_count_the_keys_a_causal_query_sees():
    assert visible_keys(4, None) == (1 + 2 + 3 + 4) / 4
    assert visible_keys(5, 2) == (1 + 2 + 2 + 2 + 2) / 5  # the query and the one before it
    assert anchor_context_keys(5, None) == (0 + 1 + 2 + 3) / 4  # anchors 0..3 see the positions before them
    assert anchor_context_keys(5, 2) == (0 + 1 + 2 + 2) / 4


def test_dense_target_forward_flops_equal_the_hand_count():
    text = Qwen3Config(num_hidden_layers=3, vocab_size=128, **TINY)
    layers = target_layer_shapes(meta_model(text), text)
    # per layer: q 64×64, k and v 64×32, o 64×64, gate/up/down 64×96 each
    linear = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 96
    assert [(s.kind, s.linear_params, s.expert_params) for s in layers] == [("full_attention", linear, 0)] * 3
    T, L = 256, 64
    attention = 4 * T * 4 * 16 * (L + 1) / 2  # QKᵀ and PV: heads × head_dim × mean visible keys
    assert target_forward_flops(layers, T, L) == 3 * (2 * T * linear + attention)


def test_moe_layers_count_top_k_of_their_experts():
    text = Qwen3MoeConfig(
        num_hidden_layers=2, vocab_size=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, **TINY
    )
    (first, second) = target_layer_shapes(meta_model(text), text)
    assert first == second
    assert first.expert_params == 8 * 3 * 64 * 32 and first.experts_active == 2 / 8
    attention_linear = 64 * 64 + 2 * 64 * 32 + 64 * 64
    assert first.linear_params in (attention_linear, attention_linear + 8 * 64)  # the router, where it is a Linear
    T = 128
    expected = 2 * (2 * T * (first.linear_params + 2 * 3 * 64 * 32) + 4 * T * 4 * 16 * (T + 1) / 2)
    assert target_forward_flops([first, second], T, T) == expected
    # an expert-parallel rank's shard holds 8/ep experts and says top_k = min(2, 8/ep) (producer/memory_plan.py's
    # worst case for memory); its tokens run k/E of its experts' weights on average, the whole model's fraction
    shard = Qwen3MoeConfig(
        num_hidden_layers=2, vocab_size=128, num_experts=2, num_experts_per_tok=2, moe_intermediate_size=32, **TINY
    )
    (rank_layer, _) = target_layer_shapes(meta_model(shard), shard, routed_fraction=2 / 8)
    assert (rank_layer.expert_params, rank_layer.experts_active) == (2 * 3 * 64 * 32, 2 / 8)


def _arch(num_layers=2, layer_types=None, window=None, **dims) -> DrafterArch:
    d = dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96) | dims
    return DrafterArch(
        **d,
        num_layers=num_layers,
        num_features=3,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        layer_types=layer_types,
        sliding_window=window,
    )


def test_drafter_flops_equal_the_hand_count():
    cfg = DrafterConfig(name="d", block_size=4, num_layers=2)
    arch = _arch(layer_types=("sliding_attention", "full_attention"), window=3)
    T, A, L, V = 64, 8, 16, 100
    Q = A * 4
    fc = 2 * T * 192 * 64
    per_layer = 2 * Q * 64 * 64 * 2 + 2 * (T + Q) * 64 * 32 * 2 + 2 * Q * 64 * 96 * 3
    ctx_sliding = sum(min(p, 3) for p in range(15)) / 15
    attention = 4 * Q * 64 * ((ctx_sliding + 4) + ((0 + 14) / 2 + 4))
    head = 2 * Q * 64 * V
    flops = drafter_flops(drafter_shapes(arch, cfg, V), DrafterBatch(T, A, L))
    assert flops == {
        "forward": fc + 2 * per_layer + attention + head,
        "backward": fc + 2 * (2 * per_layer + attention) + head,
    }


def test_muon_counts_newton_schulz_over_the_real_split():
    cfg = DrafterConfig(name="d", block_size=4, num_layers=2)
    params, shapes = trained_matrices(_arch(), cfg, 100)
    per_layer = [(64, 64), (32, 64), (32, 64), (64, 64), (96, 64), (96, 64), (64, 96)]
    assert sorted(shapes) == sorted(per_layer * 2 + [(64, 192)])  # q k v o gate up down; the fc fusion
    norms = 2 * (2 * 64 + 2 * 16) + 2 * 64  # input/post norms, q/k norms per layer; hidden_norm, norm
    assert params == sum(a * b for a, b in shapes) + norms
    assert newton_schulz_flops([(32, 64)], 5) == 5 * (4 * 32 * 32 * 64 + 2 * 32**3)
    assert trained_matrices(_arch(), cfg.model_copy(update={"optimizer": "adamw"}), 100)[1] == []


def test_the_muon_split_counts_the_busiest_replicas_share_and_what_it_receives():
    """Three 4×8 matrices (cost c each) and a 2×2 over 2 replicas: owners [0, 1, 0, 1] (consumer/muon.py)."""
    shapes = [(4, 8), (4, 8), (4, 8), (2, 2)]
    c, small = newton_schulz_flops([(4, 8)], 5), newton_schulz_flops([(2, 2)], 5)
    assert muon_split(shapes, 5, 1, False) == (3 * c + small, 0.0)
    # replicated: rank 0 owns two 4×8 and receives the other 4×8 and the 2×2 in bf16; rank 1 receives two 4×8
    assert muon_split(shapes, 5, 2, False) == (2 * c, max(2 * (32 + 4), 2 * 2 * 32))
    # FSDP: an owner receives the other half of each owned matrix's rows, and its half of each other matrix
    assert muon_split(shapes, 5, 2, True) == (2 * c, max(2 * (2 * 16 + 16 + 2), 2 * (16 + 2 + 2 * 16)))


def test_the_optimizer_line_names_the_tokens_per_step_that_brings_it_under_15_percent():
    rate = rates(DEVICES["h200"], 0.5)  # 494.5 TFLOP/s
    work = Work(
        "drafter a",
        2,
        {"forward": ("flops", 494.5e12), "optimizer": ("flops", 494.5e12 / 2)},  # 1 s a batch, 0.5 s a step
        step_parts=("optimizer",),
    )
    # 0.5 / 1.5 = 33 %; k batches a step: 0.5/k / (1 + 0.5/k) ≤ 15 % from k = 3 (14 %)
    assert optimizer_line(work, rate, 1000) == (
        "optimizer: 33 % of a replica's time per batch, above 15 %: tokens_per_step = 6,000 (3 batches a replica"
        " a step) brings it to 14 %"
    )
    at_three = Work(work.stage, 2, {**work.parts, "optimizer": ("flops", 494.5e12 / 6)}, "", 3.0, ("optimizer",))
    assert optimizer_line(Work.from_json(at_three.to_json()), rate, 1000) == (
        "optimizer: 14 % of a replica's time per batch (at most 15 %)"
    )
    assert optimizer_line(Work("target forward", 1, {"forward": ("flops", 1.0)}), rate, 1000) is None


def test_anchors_per_batch_follow_the_samples_and_the_budget():
    assert batch_anchors(budget=4096, tokens=4096, seq_len=512, anchors_per_seq=256) == 8 * 256
    assert batch_anchors(budget=1024, tokens=4096, seq_len=512, anchors_per_seq=256) == 1024
    # 40.96 samples of 100 tokens, 99 anchors each (p ≤ L − 2), rounded up
    assert batch_anchors(budget=4096, tokens=4096, seq_len=100, anchors_per_seq=256) == 4056


def test_render_names_the_slowest_stage_and_the_job_rates():
    works = [
        Work("target forward", 2, {"forward": ("flops", 989e12)}),  # 2 s at 50 %: 1 batch/s over 2
        Work("hand-off", 2, {"to drafter GPUs": ("nvlink", 375e9 * 0.01)}),
        Work("drafter a", 4, {"forward": ("flops", 0.5 * 989e12), "optimizer state": ("hbm", 0.8 * 4.8e12)}),
    ]
    text = render(works, DEVICES["h200"], "--device h200", 0.5, 1000, 250, "assumed", REFERENCES["qwen3-8b-8xh200"])
    lines = text.splitlines()
    assert "MFU of 50%" in lines[0]
    drafter = next(ln for ln in lines if ln.strip().startswith("drafter a"))
    assert drafter.split()[3:5] == ["2000.0", "2.00"]  # 1 s + 1 s on each of 4 replicas: 2 batches/s
    assert "optimizer state 1000.0 ms (50 %, 3840.00 GB hbm)" in drafter
    assert lines[-2] == (
        "bottleneck: target forward at 1.00 batches/s; the job: 1,000 tokens/s, 4.0 samples/s at 250-token"
        " samples (assumed)"
    )
    assert lines[-1].startswith("published: 50.1 samples/s against our predicted 4.0 (SpecForge")


def test_the_device_is_named_or_inferred_from_its_memory():
    assert infer_device("h200", None)[0] is DEVICES["h200"]
    assert infer_device(None, 139.7) == (DEVICES["h200"], "inferred from --device-memory 139.7")
    assert infer_device(None, 79)[0] is DEVICES["h100"]
    assert infer_device(None, None) == (DEVICES["h100"], "assumed (pass --device h100|h200)")


def test_the_producer_plans_the_forward_tp_all_reduce_and_hand_off(tmp_path):
    text = Qwen3Config(num_hidden_layers=4, vocab_size=128, **TINY)
    job = load_job(
        write_job(
            tmp_path / "job.toml",
            {
                "job": {"name": "tp", "run_dir": str(tmp_path / "run")},
                "target": {"path": str(tmp_path), "tp_size": 2, "devices": ["cuda:0", "cuda:1"], "layer_ids": [0, 2]},
                "data": {"path": str(tmp_path / "d.jsonl"), "max_length": 64, "tokens_per_batch": 256},
                "transport": {"kind": "cuda"},
                "drafters": [
                    {"name": "a", "devices": ["cuda:2"]},
                    {"name": "b", "devices": ["cuda:0"]},
                ],
            },
        )
    )
    forward, handoff = target_work(job, text, 64)
    linear = 64 * 32 + 2 * 64 * 16 + 32 * 64 + 3 * 64 * 48  # a rank: half the heads and half the MLP width
    assert forward.parts["forward"] == ("flops", 3 * (2 * 256 * linear + 4 * 256 * 2 * 16 * 65 / 2))
    assert forward.parts["TP all-reduce"] == ("nvlink", 3 * 2 * (2 * 1 / 2 * 256 * 64 * 2))
    features = 256 * 2 * 64 * 2
    assert handoff.parts == {"to drafter GPUs": ("nvlink", features), "on the ring's GPU": ("hbm", 2 * features)}


# ------------------------------------------------------------------------ calibration against a measured CPU step
def seconds(run, repeats: int = 1) -> float:
    t0 = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - t0) / repeats


def cpu_rates(h: int, i: int) -> dict[str, float]:
    """This CPU's achieved rates now: fp32 matmul FLOP/s ([512, h] @ [h, i], the step's shapes), bf16 FLOP/s of
    Newton–Schulz's matmuls on an [h, i] matrix (as torch's Muon runs them), copy bytes/s."""
    a, b = torch.randn(512, h), torch.randn(h, i)
    x = torch.randn(h, i, dtype=torch.bfloat16)

    def iteration():
        g = x @ x.mT
        torch.addmm(x, torch.addmm(g, g, g, beta=-4.7750, alpha=2.0315), x, beta=3.4445)

    src, dst = torch.randn(16 * 2**20), torch.empty(16 * 2**20)
    return {
        "fp32": 2 * 512 * h * i / seconds(lambda: a @ b, 20),
        "bf16": (4 * h * h * i + 2 * h**3) / seconds(iteration, 10),
        "copy": 2 * src.numel() * 4 / seconds(lambda: dst.copy_(src), 10),
    }


def paired_ratio(run, predict, h: int, i: int, repeats: int = 3) -> float:
    """Median over `repeats` of predicted / measured seconds, the rates measured right before each timed run
    (the machine is shared: a run and its rates see the same load)."""
    run()  # warm-up: first-call allocations, lazy inits
    ratios = []
    for _ in range(repeats):
        rates = cpu_rates(h, i)
        ratios.append(predict(rates) / seconds(run))
    print("predicted / measured:", [f"{r:.2f}" for r in ratios])
    return sorted(ratios)[len(ratios) // 2]


def test_predicted_step_times_match_a_measured_cpu_run():
    """The FLOP model, run at this CPU's measured matmul rates (MFU 1: fp32 for the step, bf16 at Newton–Schulz's
    shapes for Muon) and copy bandwidth, predicts the real drafter train step (forward, chunked LM-head loss,
    backward, clipping, Muon + AdamW step: consumer/model.py's CPU path) and a real target forward within the
    band 0.4–2.5. The model leaves element-wise work (norms, RoPE, softmax, SiLU, the loss) to the MFU; on this
    single-threaded CPU it (with SDPA over 64 tiny blocks) is about half the drafter's step, so the shapes are
    matmul-heavy (hidden 768, 8,192-token vocabulary, 512 query rows) and the prediction is expected below
    the measurement: measured ratios 0.44–0.50 (drafter step) and 0.65–0.88 (target forward) when written."""
    from consumer.dflash2 import make_drafter
    from consumer.loss import chunked_lm_head_loss
    from consumer.objective import attention_masks, build_draft_batch
    from consumer.optim import build_optimizer

    H, W, V, T, L = 768, 2304, 8192, 512, 128
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core, the same for the rates and the runs
    try:
        cfg = DrafterConfig(name="d", block_size=8, num_layers=2, anchors_per_seq=16)
        arch = _arch(hidden_size=H, num_heads=6, num_kv_heads=2, head_dim=128, intermediate_size=W)
        gen = torch.Generator().manual_seed(0)
        model = make_drafter(cfg, arch, torch.randn(V, H) * 0.02, torch.randn(V, H) * 0.02, 0)
        optimizer, _ = build_optimizer(cfg, model.named_parameters(), lambda step: 1.0)
        params = [p for p in model.parameters() if p.requires_grad]
        batch = build_draft_batch(
            torch.randint(0, V, (T,), generator=gen), torch.ones(T, dtype=torch.uint8),
            torch.arange(0, T + 1, L, dtype=torch.int32), anchors_per_seq=16, block_size=8, mask_token_id=0,
            gamma=7.0, generator=gen,
        )  # fmt: skip
        masks = attention_masks(batch, arch.attention_layers, None, flex=False)
        features = torch.randn(T, 3 * H, generator=gen)

        def step():
            h = model(features, batch.ctx_pos, batch.block_ids, batch.block_pos, masks)
            loss, _ = chunked_lm_head_loss(h, model.lm_head, batch.labels, batch.weights, cfg.loss_chunk_rows)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        n_params, shapes = trained_matrices(arch, cfg, V)
        flops = drafter_flops(drafter_shapes(arch, cfg, V), DrafterBatch(T, batch.num_anchors, L))
        assert batch.num_anchors == 4 * 16

        def predict(rates: dict[str, float]) -> float:
            return (
                (flops["forward"] + flops["backward"]) / rates["fp32"]
                + newton_schulz_flops(shapes, cfg.muon_ns_steps) / rates["bf16"]
                + ELEMENTWISE_BYTES_PER_PARAM * n_params / rates["copy"]
            )

        assert 0.4 < paired_ratio(step, predict, H, W) < 2.5

        text = Qwen3Config(
            num_hidden_layers=2, vocab_size=V, hidden_size=H, intermediate_size=W, num_attention_heads=6,
            num_key_value_heads=2, head_dim=128,
        )  # fmt: skip
        with torch.device("meta"):
            layers = target_layer_shapes(AutoModel.from_config(text), text)
        target = AutoModel.from_config(text, attn_implementation="sdpa").eval()
        ids = torch.randint(0, V, (1, T), generator=gen)

        def forward():
            with torch.no_grad():
                target(input_ids=ids, use_cache=False)

        target_flops = target_forward_flops(layers, T, T)  # one causal sequence of T tokens
        assert 0.4 < paired_ratio(forward, lambda rates: target_flops / rates["fp32"], H, W) < 2.5
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------ the dry run's section
@pytest.mark.slow
@pytest.mark.parametrize(
    "job, config, stages, bottleneck, published",
    [
        (
            "qwen3-8b-8xh200.toml",
            "qwen3-8b",
            ["target forward", "hand-off", "drafter b16"],
            "target forward",
            "50.1",
        ),
        (
            "qwen36-27b-8gpu.toml",
            "qwen36-27b",
            ["target forward", "hand-off", "drafter b16", "drafter b8"],
            "drafter b16",
            "10.65",
        ),
    ],
)
def test_the_example_jobs_dry_run_prints_the_throughput_plan(job, config, stages, bottleneck, published):
    """launch.sh --dry-run → common.launch_plan → both roles' throughput-plan commands, after the memory plan."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHON": sys.executable}
    command = [str(ROOT / "launch.sh"), str(ROOT / "deploy/examples" / job), "--dry-run", "--device", "h200"]
    command += ["--target-config", str(ROOT / "deploy/examples/configs" / config)]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("planned throughput per batch of"))
    assert any(ln.startswith("planned GPU memory") for ln in lines[:start])  # the memory plan comes first
    section = lines[start:]
    assert "device H200 SXM (--device h200): 989 TFLOP/s dense bf16 at an assumed MFU of 45%" in section[0]
    rows = [ln[2:26].strip() for ln in section[2:] if ln.startswith("  ") and ln[2:26].strip()]
    assert rows == stages
    drafters = [ln for ln in section if ln.startswith("  drafter ")]
    assert all(" optimizer " in ln and " backward " in ln for ln in drafters)
    # issue 34: Newton–Schulz split over the replicas, and tokens_per_step where needed, keep the optimizer at
    # most 15 % of each replica's time
    shares = [ln.strip() for ln in section if ln.strip().startswith("optimizer: ")]
    assert len(shares) == len(drafters) and all(ln.endswith("(at most 15 %)") for ln in shares), shares
    last = section[-2]
    assert last.startswith(f"bottleneck: {bottleneck} at ") and " tokens/s, " in last, last
    predicted = float(last.split(" samples/s at ")[0].rsplit(" ", 1)[1])
    assert section[-1].startswith(f"published: {published} samples/s against our predicted {predicted:.1f} (")
