"""What one drafter layer keeps for its backward under bf16 autocast (as the CUDA trainer runs it), counted on
fake tensors: every tensor the autograd graph saves, once per storage, against a figure worked out by hand.

It pins issue 34 §2: the RMSNorms hand the projections bf16 (Qwen3's `weight * x.to(input_dtype)`), so q/k/v
and gate/up share one bf16 input and RoPE runs in bf16; a float32 norm output made each projection save its
own bf16 cast and RoPE save float32 cos/sin (3,582,464 bytes here before)."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention.flex_attention import BlockMask

from consumer import memory_plan
from consumer.kernels.flex import FLEX_TILE
from consumer.model import DecoderLayer, DrafterArch

H, h, hk, d, F = 256, 4, 2, 64, 512  # hidden, query heads, kv heads, head size, MLP width
T, Q = 256, 128  # context rows, block rows: multiples of FLEX_TILE, so attend pads nothing


def _block_mask() -> BlockMask:
    nq, nk = Q // FLEX_TILE, (T + Q) // FLEX_TILE
    z = lambda *shape: torch.zeros(*shape, dtype=torch.int32)  # noqa: E731
    rows, cols = (z(1, 1, nq), z(1, 1, nq, nk)), (z(1, 1, nk), z(1, 1, nk, nq))
    return BlockMask((Q, T + Q), *rows, *rows, *cols, *cols, (FLEX_TILE, FLEX_TILE))


def saved_bytes_of_one_layer() -> int:
    arch = DrafterArch(
        hidden_size=H,
        num_heads=h,
        num_kv_heads=hk,
        head_dim=d,
        intermediate_size=F,
        num_layers=1,
        num_features=2,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
    )
    storages = {}  # id → (storage, bytes): the storage is kept alive so that no id is reused

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        storages.setdefault(id(st), (st, st.nbytes()))
        return t

    # FlexAttention stood in as the memory plan does: saves q, k, v, out and the float32 log-sum-exp
    with FakeTensorMode(allow_non_fake_inputs=True), memory_plan._kernels_stood_in(cuda=True):
        layer = DecoderLayer(arch)  # float32 master weights, as trained
        x = torch.empty(Q, H, dtype=torch.bfloat16, requires_grad=True)  # a later layer's input
        ctx = torch.empty(T, H, dtype=torch.bfloat16, requires_grad=True)  # fc's output, trained
        rope_ctx = torch.empty(T, 1, d), torch.empty(T, 1, d)  # float32, as DFlashDrafter.rope makes them
        rope_blk = torch.empty(Q, 1, d), torch.empty(Q, 1, d)
        saving = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with saving, torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x, ctx, rope_ctx, rope_blk, _block_mask())
    return sum(n for _, n in storages.values())


def rms_norm(rows: int, width: int) -> int:
    """x in float32 (pow), rsqrt [rows, 1] in float32, the normalised x in bf16 (for the weight's gradient),
    the weight in bf16 (for x's)."""
    return 4 * rows * width + 4 * rows + 2 * rows * width + 2 * width


def test_one_layer_saves_bf16_projection_inputs_and_bf16_rope():
    weights = 2 * (h * d * H + 2 * hk * d * H + H * h * d + 3 * F * H)  # q, k, v, o, gate, up, down: bf16 casts
    norms = 2 * rms_norm(Q, H) + rms_norm(Q * h, d) + rms_norm(T * hk, d) + rms_norm(Q * hk, d)
    linear_inputs = 2 * Q * H + 2 * Q * H + 2 * T * H  # the two norms' outputs (each shared by its projections), ctx
    rope = 2 * (2 * Q * d) + 2 * (2 * T * d) + 2 * (2 * Q * d)  # bf16 cos and sin of q, k_ctx, k_blk
    flex = 2 * h * Q * d + 2 * (2 * hk * (T + Q) * d) + 2 * h * Q * d + 4 * h * Q  # q, k, v, out, lse
    mlp = 4 * (2 * Q * F)  # gate's output (silu), silu's output, up's output, their product (down's input)
    expected = weights + norms + linear_inputs + rope + flex + mlp
    assert expected == 3_319_168
    assert saved_bytes_of_one_layer() == expected
