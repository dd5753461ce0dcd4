"""Tensors between deployments: packed as raw bytes with their dtype and shape.

What crosses a Serve handle call or the same-node channel (pickled): a draft tree's
proposal distributions (:meth:`~speclab.decoding.tree.TokenTree.to_wire`), the target's
features with a verdict. Compact and exact; never JSON lists of floats.
"""

from __future__ import annotations

import torch


def pack_tensor(t: torch.Tensor | None) -> dict | None:
    """A tensor as ``{dtype, shape, data: raw bytes}`` for deployment handle calls (compact
    and exact; never JSON lists of floats). None stays None."""
    if t is None:
        return None
    t = t.detach().contiguous().cpu()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": t.view(torch.uint8).numpy().tobytes() if t.numel() else b""}


def unpack_tensor(data: dict | torch.Tensor | None) -> torch.Tensor | None:
    """Inverse of :func:`pack_tensor` (a tensor or None is returned as is)."""
    if data is None or isinstance(data, torch.Tensor):
        return data
    dtype = getattr(torch, data["dtype"])
    if not data["data"]:
        return torch.zeros(data["shape"], dtype=dtype)
    raw = torch.frombuffer(bytearray(data["data"]), dtype=torch.uint8)
    return raw.view(dtype).reshape(data["shape"]).clone()
