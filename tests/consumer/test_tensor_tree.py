"""The msgpack state tree that replaces torch.save bytes on the replica group's checkpoint broadcast."""

import pickle

import msgpack
import pytest
import torch

from consumer import tensor_tree


def _adam_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": 1,
        "last_seq": 41,
        "rng": torch.Generator().manual_seed(7).get_state(),
        "lr": 1e-3,
        "name": "b16",
        "none": None,
    }


def test_round_trip_of_a_real_optimizer_state_is_exact():
    state = _adam_state()
    got = tensor_tree.unpack(tensor_tree.pack(state))
    assert list(got["optimizer"]["state"]) == [0, 1, 2, 3]  # int keys stay ints
    assert got["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)  # a tuple, not a list
    assert (got["step"], got["last_seq"], got["lr"], got["name"], got["none"]) == (1, 41, 1e-3, "b16", None)
    for key, t in state["model"].items():
        assert torch.equal(got["model"][key], t) and got["model"][key].dtype == t.dtype
    for i, s in state["optimizer"]["state"].items():
        for k, t in s.items():
            assert torch.equal(got["optimizer"]["state"][i][k], t), (i, k)
    assert torch.equal(got["rng"], state["rng"]) and got["rng"].dtype == torch.uint8
    # the state loads into a fresh optimizer and continues identically
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model.load_state_dict(got["model"])
    opt = torch.optim.AdamW(model.parameters())
    opt.load_state_dict(got["optimizer"])
    assert opt.param_groups[0]["betas"] == (0.9, 0.95)


def test_dtypes_shapes_and_views():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tree = {
        "bf16": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
        "view": base.t()[1:],
        "scalar": torch.tensor(3, dtype=torch.int64),
        "empty": torch.empty(0, 5),
        "flag": torch.tensor([True, False]),
        "nested": [(1, "a", torch.ones(2, dtype=torch.float16))],
    }
    got = tensor_tree.unpack(tensor_tree.pack(tree))
    assert got["bf16"].dtype == torch.bfloat16 and got["bf16"].tolist() == [1.5, -2.25]
    assert got["view"].tolist() == [[1.0, 5.0, 9.0], [2.0, 6.0, 10.0], [3.0, 7.0, 11.0]]
    assert got["scalar"].shape == () and int(got["scalar"]) == 3
    assert got["empty"].shape == (0, 5)
    assert got["flag"].tolist() == [True, False]
    one, a, half = got["nested"][0]
    assert (one, a) == (1, "a") and half.dtype == torch.float16 and half.tolist() == [1.0, 1.0]
    got["view"] += 1  # writable, and not aliasing the sender's tensor
    assert base[0, 1] == 1.0


def test_no_pickle_either_way():
    data = tensor_tree.pack({"x": torch.ones(3)})
    assert pickle.PROTO not in data[:1]  # plain msgpack, not a pickle stream
    with pytest.raises(TypeError, match="object"):
        tensor_tree.pack({"bad": object()})
    with pytest.raises(ValueError, match="unknown msgpack extension 9"):
        tensor_tree.unpack(msgpack.packb(msgpack.ExtType(9, b"")))
