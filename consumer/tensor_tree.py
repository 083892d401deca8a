"""A nested state (dicts, lists, tuples, scalars, strings, tensors) as msgpack bytes: no pickle.

Used where a whole trainer state crosses a process boundary (the resume checkpoint rank 0 broadcasts to its
replicas, consumer/distributed.py). Tensors travel as msgpack extension 1: [dtype name, shape, raw bytes] of a
contiguous CPU copy; tuples as extension 2 (optimizer param groups keep their tuple betas); int dict keys stay
ints (optimizer state is keyed by parameter index). Anything else is a TypeError naming where it sits.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch

TENSOR, TUPLE = 1, 2
DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def _tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def pack(tree: Any) -> bytes:
    """`tree` as msgpack bytes; raises TypeError naming the path of an unsupported value."""

    def default(obj: Any) -> msgpack.ExtType:
        if isinstance(obj, torch.Tensor):
            name = str(obj.dtype).removeprefix("torch.")
            if name not in DTYPES:
                raise TypeError(f"tensor dtype {obj.dtype} cannot be sent")
            head = msgpack.packb([name, list(obj.shape)], use_bin_type=True)
            return msgpack.ExtType(TENSOR, len(head).to_bytes(4, "little") + head + _tensor_bytes(obj))
        if isinstance(obj, tuple):
            return msgpack.ExtType(TUPLE, pack(list(obj)))
        raise TypeError(f"a {type(obj).__name__} cannot be sent in a state tree")

    return msgpack.packb(_no_tuples(tree), default=default, use_bin_type=True, strict_types=True)


def _no_tuples(tree: Any) -> Any:
    """`pack` uses strict_types so that tuples reach `default` (plain msgpack would turn them into lists), which
    also sends dict subclasses there (a state_dict is an OrderedDict): make every mapping a plain dict."""
    if isinstance(tree, dict):
        return {k: _no_tuples(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_no_tuples(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_no_tuples(v) for v in tree)
    return tree


def unpack(data: bytes) -> Any:
    """The tree `pack` encoded; tensors come back as fresh, writable CPU tensors."""

    def ext_hook(code: int, raw: bytes) -> Any:
        if code == TENSOR:
            n = int.from_bytes(raw[:4], "little")
            name, shape = msgpack.unpackb(raw[4 : 4 + n], raw=False)
            dtype = DTYPES[name]
            body = bytearray(raw[4 + n :])
            if not body:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(body, dtype=torch.uint8).view(dtype).reshape(shape)
        if code == TUPLE:
            return tuple(unpack(raw))
        raise ValueError(f"unknown msgpack extension {code} in a state tree")

    return msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=False)
