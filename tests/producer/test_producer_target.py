"""Target capture: features equal HF output_hidden_states, packed sequences stay independent, tail never runs.

The architecture matrix (every layer kind, multimodal wrappers) is tests/producer/test_targets_matrix.py.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from producer.target import TargetLoadError, load_target
from tests.target_zoo import build_target

N_LAYERS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_target("qwen3", tmp_path_factory.mktemp("target") / "model", num_layers=N_LAYERS, seed=3)


@pytest.fixture(scope="module")
def full_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()


def reference(full_model, ids, layer_ids, position_ids=None, **kwargs):
    with torch.no_grad():
        hs = full_model(
            ids[None], position_ids=position_ids, use_cache=False, output_hidden_states=True, **kwargs
        ).hidden_states
    return torch.cat([hs[i + 1][0] for i in layer_ids], dim=-1)


def test_single_sequence_features_equal_hidden_states_exactly(model_dir, full_model):
    every = list(range(N_LAYERS))
    cap = load_target(model_dir, layer_ids=every, dtype="float32")
    ids = torch.randint(0, full_model.config.vocab_size, (23,), generator=torch.Generator().manual_seed(0))
    feats = cap(ids, torch.tensor([0, 23]))
    assert feats.shape == (23, N_LAYERS * 64) and feats.dtype == torch.float32
    assert torch.equal(feats, reference(full_model, ids, every))


def test_packed_batch_equals_full_model_on_the_same_packed_input(model_dir, full_model):
    cap = load_target(model_dir, num_features=3, dtype="float32")
    assert cap.layer_ids == [1, 2, 3]
    lens = [5, 17, 1, 30]
    cu = torch.tensor([0, 5, 22, 23, 53])
    ids = torch.randint(0, full_model.config.vocab_size, (53,), generator=torch.Generator().manual_seed(1))
    feats = cap(ids, cu)
    # exact: the full model on the same packed input (transformers' own packed path: restarting positions,
    # the sequence bounds for the attention), with the capture's attention implementation
    assert (cap.packing, cap.attn_implementation) == ("position_ids", "packed_sdpa")
    same_attention = AutoModelForCausalLM.from_pretrained(
        model_dir, local_files_only=True, dtype=torch.float32, attn_implementation=cap.attn_implementation
    ).eval()
    positions = torch.cat([torch.arange(n) for n in lens])[None]
    bounds = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}
    assert torch.equal(feats, reference(same_attention, ids, cap.layer_ids, positions, **bounds))
    # and up to fp32 reduction order, plain sdpa over the dense packed mask
    torch.testing.assert_close(feats, reference(full_model, ids, cap.layer_ids, positions), rtol=0, atol=1e-5)
    # independent: each sequence alone gives the same features (up to fp32 reduction order)
    for b in range(4):
        s, e = int(cu[b]), int(cu[b + 1])
        torch.testing.assert_close(feats[s:e], reference(full_model, ids[s:e], cap.layer_ids), rtol=0, atol=1e-5)


def test_layers_after_the_last_captured_one_never_run(model_dir):
    cap = load_target(model_dir, layer_ids=[0, 3], dtype="float32")
    calls = []
    for i, layer in enumerate(cap.model.layers):
        layer.register_forward_hook(lambda *_, i=i: calls.append(i))
    cap(torch.arange(10), torch.tensor([0, 4, 10]))
    assert calls == [0, 1, 2, 3]
    assert cap.layers_run == 4 < cap.num_target_layers == N_LAYERS
    assert not any("lm_head" in name for name, _ in cap.model.named_parameters())
    assert not any(p.requires_grad for p in cap.model.parameters())


def test_out_buffer_is_filled_in_place_and_checked(model_dir):
    cap = load_target(model_dir, layer_ids=[2], dtype="float32")
    out = torch.zeros(8, 64)
    assert cap(torch.arange(8), torch.tensor([0, 8]), out=out) is out
    assert out.abs().sum() > 0
    with pytest.raises(ValueError, match="expected"):
        cap(torch.arange(8), torch.tensor([0, 8]), out=torch.zeros(8, 65))
    with pytest.raises(ValueError, match="cu_seqlens"):
        cap(torch.arange(8), torch.tensor([0, 3, 3, 8]))


def test_bfloat16_target_returns_bfloat16(model_dir):
    cap = load_target(model_dir, num_features=2, dtype="bfloat16")
    assert cap(torch.arange(6), torch.tensor([0, 6])).dtype == torch.bfloat16


def test_load_errors_name_the_path(model_dir, tmp_path):
    with pytest.raises(TargetLoadError, match="does not exist"):
        load_target(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TargetLoadError, match=r"no config\.json"):
        load_target(tmp_path / "empty")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(TargetLoadError, match=r"no_weights: cannot load.*no \*.safetensors"):
        load_target(no_weights, num_features=2, dtype="float32")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((model_dir / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(TargetLoadError, match=r"broken/model.safetensors: corrupt safetensors header"):
        load_target(broken, num_features=2, dtype="float32")
    data = (model_dir / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(TargetLoadError, match=r"broken/model.safetensors: truncated or corrupt: its header declares"):
        load_target(broken, num_features=2, dtype="float32")
    (broken / "model.safetensors").write_bytes(data[:8] + b"{" * (len(data) - 8))
    with pytest.raises(TargetLoadError, match=r"broken/model.safetensors: corrupt safetensors header"):
        load_target(broken, num_features=2, dtype="float32")
    (broken / "config.json").write_text('{"model_type": "qwen3", ')
    with pytest.raises(TargetLoadError, match=r"broken/config.json: not valid JSON"):
        load_target(broken)
    with pytest.raises(TargetLoadError, match=r"layer ids \[1, 6\]"):
        load_target(model_dir, layer_ids=[1, 6])
    bad_cfg = tmp_path / "bad_cfg"
    bad_cfg.mkdir()
    (bad_cfg / "config.json").write_text(json.dumps({"model_type": "nonexistent-arch"}))
    with pytest.raises(TargetLoadError, match="not a usable model config"):
        load_target(bad_cfg)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("attn", ["sdpa", "flex_attention"])
def test_cuda_capture_matches_cpu(model_dir, attn):
    cpu = load_target(model_dir, num_features=3, dtype="float32", attn_implementation=attn)
    gpu = load_target(model_dir, num_features=3, dtype="float32", device="cuda", attn_implementation=attn)
    ids, cu = torch.randint(0, 200, (40,)), torch.tensor([0, 7, 40])
    feats = gpu(ids, cu)
    assert feats.device.type == "cuda"
    torch.testing.assert_close(feats.cpu(), cpu(ids, cu), rtol=1e-4, atol=1e-4)
