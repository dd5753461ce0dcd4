"""Host-device synchronisations per round (issue 34, item 11), counted on the CPU.

On a GPU, every read of a device tensor from the host (``.tolist()``, ``.item()``,
``int(t)``, ``.cpu()``, ...) waits for the device. This test marks every tensor the
models compute as "on the device" (a tensor subclass that propagates through every op
derived from the logits) and counts two things while real decoding runs:

* ``stray``: reads of a marked tensor that bypass :func:`speclab.decoding.host.fetch`
  (each would be one more wait per row or per node on a GPU). Must be 0.
* ``syncs``: the waits through :mod:`speclab.decoding.host`. At most one per model
  forward (the verify forward's verdict; a draft forward's top tokens), plus a constant,
  however many rows and tree nodes there are.
"""

from __future__ import annotations

import pytest
import torch

from speclab.api import Decoder
from speclab.decoding import host

_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__float__,
          torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy}


def _to_host(args: tuple, kwargs: dict) -> bool:
    """Whether a ``Tensor.to`` call moves its tensor to the CPU."""
    for a in (*args[1:], kwargs.get("device")):
        if isinstance(a, str | torch.device) and torch.device(a).type == "cpu":
            return True
        if isinstance(a, torch.Tensor) and type(a) is torch.Tensor:
            return True  # .to(a host tensor)
    return False


class OnDevice(torch.Tensor):
    """A tensor that lives "on the device": reading it from the host is counted."""

    stray = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS or (func is torch.Tensor.to and _to_host(args, kwargs)):
            OnDevice.stray += 1
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out
        return super().__torch_function__(func, types, args, kwargs)


def test_the_marker_sees_reads_and_fetch_reads_once():
    t = torch.arange(6.0).as_subclass(OnDevice)
    u = (t * 2).softmax(-1)
    assert type(u) is OnDevice
    OnDevice.stray = 0
    int(u.argmax()), u.tolist(), float(u[0]), u.to("cpu")
    assert OnDevice.stray == 4
    before = host.SYNCS.syncs
    a, b = host.fetch(u, u.argmax())
    assert host.SYNCS.syncs == before + 1 and type(a) is torch.Tensor and type(b) is torch.Tensor
    a.tolist(), int(b)
    assert OnDevice.stray == 4


@pytest.fixture(scope="module")
def marked(tiny_pair):
    """A decoder whose target and draft compute "device" logits; counts model forwards."""
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    forwards = {"n": 0}
    for model in (dec.target.model, dec.draft.model):
        model.get_output_embeddings().register_forward_pre_hook(
            lambda _m, args: (args[0].as_subclass(OnDevice), *args[1:]))
        model.register_forward_hook(lambda *_: forwards.__setitem__("n", forwards["n"] + 1))
    return dec, forwards


def _count(marked, **kw) -> tuple[int, int, int]:
    """(stray reads, syncs, model forwards) of one generate call."""
    dec, forwards = marked
    OnDevice.stray, syncs0, fw0 = 0, host.SYNCS.syncs, forwards["n"]
    dec.generate(**kw)
    return OnDevice.stray, host.SYNCS.syncs - syncs0, forwards["n"] - fw0


METHODS = [("ar", {}), ("chain", {"gamma": 2}), ("chain", {"gamma": 6}),
           ("tree", {"tree_top_k": 2, "depth": 3, "nodes": 4}),
           ("tree", {"tree_top_k": 6, "depth": 3, "nodes": 24}),
           ("salf", {"nodes": 24, "batch": 4})]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("method,knobs", METHODS)
def test_one_wait_per_forward_single_row(marked, method, knobs, temperature):
    stray, syncs, forwards = _count(marked, prompt_ids=[1, 2, 3, 4], method=method,
                                    max_new_tokens=20, temperature=temperature, seed=3, **knobs)
    assert stray == 0, f"{stray} host reads bypassed speclab.decoding.host.fetch"
    assert syncs <= forwards + 1, (syncs, forwards)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("method,knobs", [("ar", {}), ("chain", {"gamma": 4}),
                                          ("tree", {"tree_top_k": 4, "depth": 3, "nodes": 12}),
                                          ("salf", {"nodes": 12, "batch": 4})])
def test_the_batched_engine_waits_per_forward_not_per_row(marked, method, knobs, temperature):
    """One row or eight in the batch: the same waits per batched forward."""
    per_forward = []
    for rows in (1, 8):
        prompts = [[1 + r, 2, 3 + r, 4] for r in range(rows)]
        stray, syncs, forwards = _count(marked, prompts=prompts, method=method,
                                        max_new_tokens=16, temperature=temperature, seed=3,
                                        **knobs)
        assert stray == 0, f"{stray} host reads bypassed speclab.decoding.host.fetch"
        assert syncs <= forwards + 1, (rows, syncs, forwards)
        per_forward.append(syncs / forwards)
    assert per_forward[1] <= per_forward[0] + 0.05, per_forward
