"""``reference-xl``: the reference target grown to GPU scale, on the GPU itself.

Why: ``reference-large`` (342M parameters) costs about 0.14 ms of memory traffic per
forward on an H200, so an eager forward there is bound by kernel launches, not memory,
and its speedups say nothing about an 8B target (16 GB of weights, 3-5 ms a forward).
``reference-xl`` has the cost of such a target and the function of the 3M reference
target: tau (a hardware-independent figure) is the small pair's, only the cost changes.

What it is (:func:`grow_reference_xl`): the trained reference target DEEPENED to
``depth`` layers (:func:`~speclab.reference_large.deepen_llama`, on the host: it is
small) and WIDENED ``widen``x (:func:`~speclab.reference_large.widened_tensors`, one
tensor at a time on the device, each copied into a bfloat16 model built there): with the
defaults (24x, 16 layers) hidden 4,608, intermediate 18,432, 96 heads of 48, 5.45B
parameters, 10.9 GB in bfloat16. No full-size copy exists on the host, and nothing is
saved: the device rebuilds it from the small target (3M parameters, carried) in seconds.
The drafters given (EAGLE / EAGLE-3 folders trained against the small target) are
widened the same way on the device (:func:`~speclab.reference_large.widen_eagle`), and
the reference draft (1 x 64) is the standalone draft as it is.

Checked by checksum (:func:`weights_checksum`): an exact integer hash of every tensor's
bits (each element's bit pattern times a weight of its position, summed modulo 2**64:
exact and independent of the summation order, so a CPU and a GPU agree bit for bit).
:func:`expected_checksums` computes it on the host from the same small folders, tensor
by tensor (``speclab gpu-bundle`` records it), and the device compares it with the
model it built: a mismatch means the device built something else (a damaged file, a
different rounding), and the report says so.

A host without CUDA can build a small ``reference-xl`` (``XLSpec(widen=2, depth=8)``)
on the CPU: the bundle's rehearsal does, to run the same code before a GPU run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from speclab.families.eagle.model import load_eagle
from speclab.models.loading import DTYPES, load_model, load_tokenizer
from speclab.reference_large import (
    deepen_llama,
    drafter_logits,
    held_out_ids,
    widen_eagle,
    widened_config,
    widened_tensors,
)
from speclab.timing import now

#: elements per chunk of :func:`tensor_checksum` (bounds its temporary memory)
CHUNK = 1 << 24


@dataclass(frozen=True)
class XLSpec:
    """How far the reference target is grown: ``widen``x wider, ``depth`` layers."""

    widen: int = 24
    depth: int = 16

    def __post_init__(self) -> None:
        if self.widen < 1 or self.depth < 1:
            raise ValueError(f"reference-xl: widen and depth must be >= 1, got {self}")

    @classmethod
    def parse(cls, text: str) -> XLSpec:
        """``"24x16"`` -> ``XLSpec(widen=24, depth=16)`` (ValueError naming ``--xl``)."""
        try:
            widen, depth = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"--xl: expected WIDENxDEPTH such as 24x16, got {text!r}") from None
        return cls(widen, depth)

    @property
    def name(self) -> str:
        return f"{self.widen}x{self.depth}"


@dataclass
class ReferenceXL:
    """A grown target (bfloat16 or the dtype asked, on its device), the draft, the
    widened EAGLE drafters by the name of their source folder, and what the build
    measured (``meta``: sizes, timings, checksums, the function check)."""

    target: torch.nn.Module
    draft: torch.nn.Module
    tokenizer: object
    drafters: dict[str, torch.nn.Module] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


def checksum_key(spec: XLSpec, dtype: str) -> str:
    """The key of a build's checksums in a checksums file: ``24x16-bfloat16``."""
    return f"{spec.name}-{dtype}"


# --- the checksum --------------------------------------------------------------------------


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@torch.no_grad()
def tensor_checksum(t: torch.Tensor) -> int:
    """An exact hash of ``t``'s bits (any shape, any dtype, any device): the sum over
    elements of (bit pattern as a signed integer) x (a weight of the flat position),
    modulo 2**64. Integer addition modulo 2**64 is associative, so the result does not
    depend on the order of the sum: CPU and CUDA give the same value."""
    flat = t.detach().contiguous().view(-1)
    bits = flat.view(_INT_VIEW[flat.element_size()])
    total = 0
    for start in range(0, bits.numel(), CHUNK):
        part = bits[start:start + CHUNK].to(torch.int64)
        pos = torch.arange(start, start + part.numel(), device=part.device, dtype=torch.int64)
        weight = (pos * 2654435761) % 4294967291 + 1
        total += int((part * weight).sum())
    return total % (1 << 64)


def weights_checksum(named: Iterator[tuple[str, torch.Tensor]]) -> str:
    """A hex digest of named tensors: SHA-256 over ``name shape dtype tensor_checksum``
    lines in name order (16 hex digits)."""
    lines = sorted(f"{n} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} "
                   f"{tensor_checksum(t)}" for n, t in named)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _grown(small_deep: torch.nn.Module, k: int, dtype: torch.dtype
           ) -> Iterator[tuple[str, torch.Tensor]]:
    """The grown target's tensors in ``dtype``, one at a time, on the host."""
    for name, t in widened_tensors(small_deep, k):
        yield name, t.to(dtype)


def _eagle_tensors(wide: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from ((n, t) for n, t in wide.state_dict().items() if not n.endswith("inv_freq"))


def expected_checksums(target_dir: str, eagles: list[str], spec: XLSpec,
                       dtype: str = "bfloat16") -> dict[str, str]:
    """The checksums :func:`grow_reference_xl` must find, computed on the host from the
    same folders one tensor at a time (the largest full-size temporary: one weight
    matrix in float32, 340 MB at the defaults): ``{"target": ..., <drafter name>: ...}``."""
    dt = DTYPES[dtype]
    base = load_model(target_dir)
    small = deepen_llama(base, spec.depth)  # float32, on the host: it is small
    out = {"target": weights_checksum(_grown(small, spec.widen, dt))}
    wide_cfg = widened_config(small.config, spec.widen)
    for folder in eagles:
        src = load_eagle(folder, base.config, field="--eagle")
        wide = widen_eagle(src, spec.widen, wide_cfg, base.config.num_hidden_layers).to(dt)
        out[Path(folder).name] = weights_checksum(_eagle_tensors(wide))
        del wide
    return out


# --- the build -----------------------------------------------------------------------------


@torch.no_grad()
def _empty_model(cls: type, config, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A ``cls(config)`` built directly on ``device`` in ``dtype`` (its initial weights
    are overwritten)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls(config).eval()
    finally:
        torch.set_default_dtype(prev)


@torch.no_grad()
def grow_reference_xl(target_dir: str, draft_dir: str, eagles: list[str] | None = None,
                      spec: XLSpec | None = None, device: str = "cuda",
                      dtype: str = "bfloat16", expected: dict[str, str] | None = None,
                      log=print) -> ReferenceXL:
    """Grow ``reference-xl`` (module docstring) from the reference pair's ``target_dir``
    and ``draft_dir`` and the small EAGLE drafters in ``eagles``, on ``device`` in
    ``dtype``. ``expected`` (:func:`expected_checksums`): each checksum is compared and
    the result recorded (``meta["checksums"]``: expected, found, match); a mismatch is
    logged, not raised, so the report can show it. Also records the function check
    (:func:`function_check`) and the build's timings."""
    spec = spec or XLSpec()
    dt = DTYPES[dtype]
    t0 = now(device)
    small_cpu = load_model(target_dir)
    small = deepen_llama(small_cpu, spec.depth)  # float32, on the host: it is small
    cfg = widened_config(small.config, spec.widen)
    cfg.dtype = dtype
    target = _empty_model(type(small), cfg, device, dt)
    params = dict(target.named_parameters())
    for name, t in widened_tensors(small, spec.widen, device):
        params[name].copy_(t)
    target.generation_config = small_cpu.generation_config
    t_target = now(device) - t0
    meta: dict = {"spec": asdict(spec), "device": str(device), "dtype": dtype,
                  "params": sum(p.numel() for p in target.parameters()),
                  "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers,
                  "intermediate": cfg.intermediate_size, "heads": cfg.num_attention_heads,
                  "weights_gb": sum(p.numel() * p.element_size()
                                    for p in target.parameters()) / 1e9,
                  "build_target_s": t_target}
    log(f"[reference-xl] {spec.name}: {meta['params'] / 1e9:.2f}B parameters "
        f"({meta['weights_gb']:.1f} GB {dtype}) built on {device} in {t_target:.1f}s")
    drafters, sources = {}, {}
    for folder in eagles or []:
        name = Path(folder).name
        sources[name] = load_eagle(folder, small_cpu.config, field="--eagle")
        wide = widen_eagle(sources[name], spec.widen, cfg, small_cpu.config.num_hidden_layers,
                           device)
        drafters[name] = wide.to(dt).eval()
    del small
    found = {"target": weights_checksum(target.named_parameters())}
    found |= {name: weights_checksum(_eagle_tensors(m)) for name, m in drafters.items()}
    meta["checksums"] = {name: {"found": f, "expected": (expected or {}).get(name),
                                "match": (expected or {}).get(name) == f if expected else None}
                         for name, f in found.items()}
    bad = [n for n, c in meta["checksums"].items() if c["match"] is False]
    log("[reference-xl] checksums: " + ("MISMATCH " + ", ".join(bad) if bad else
                                         "match" if expected else "not checked (none given)"))
    meta["build_s"] = now(device) - t0
    draft = load_model(draft_dir, dtype, device)
    tok = load_tokenizer(target_dir)
    xl = ReferenceXL(target, draft, tok, drafters, meta)
    meta["function_check"] = function_check(small_cpu, sources, xl, target_dir)
    log(f"[reference-xl] function check: {json.dumps(meta['function_check'])}")
    return xl


@torch.no_grad()
def function_check(small: torch.nn.Module, sources: dict[str, torch.nn.Module],
                   xl: ReferenceXL, target_dir: str, tokens: int = 128) -> dict:
    """How exactly the grown models reproduce the small ones on ``tokens`` held-out ids:
    the target's greedy agreement and largest logit difference (the small target in
    float32 on the host), and each grown drafter's (fed the grown target's features)
    with its small source in ``sources`` (fed the small target's). 1.0 up to the grown
    weights' rounding."""
    ids = held_out_ids(target_dir, tokens)
    device = next(xl.target.parameters()).device
    s_logits = small(input_ids=torch.tensor([ids])).logits[0].float()
    x_logits = xl.target(input_ids=torch.tensor([ids], device=device)).logits[0].float().cpu()
    out = {"tokens": len(ids),
           "target_greedy_agreement": float((s_logits.argmax(-1) == x_logits.argmax(-1))
                                            .float().mean()),
           "target_logits_max_abs_diff": float((s_logits - x_logits).abs().max())}
    for name, wide in xl.drafters.items():
        s_draft = drafter_logits(small, sources[name], ids)
        x_draft = drafter_logits(xl.target, wide, ids).cpu()
        out[f"{name}_greedy_agreement"] = float((s_draft.argmax(-1) == x_draft.argmax(-1))
                                                .float().mean())
    return out
