"""``speclab calibrate``: a pair's forward cost curves on the device and dtype in use,
stored as JSON and reused until the models change (imports torch; no Ray, no MLflow).

A calibration holds, for the target and the draft model (when the pair has one), the
seconds of one forward by rows and new tokens (:class:`speclab.forward_costs.CostCurve`,
measured by :class:`speclab.forward_costs.CostSampler` on the runner each engine uses):
``single`` (the one-sequence engine, one row) and ``batched`` (the batched engine and
Serve, rows 1, 2, 4, ... up to the largest batch size asked for), on top of a context of
``context`` tokens. It is stored at ``$SPECLAB_HOME/calibration/<key>.json``, the key a
hash of both models' fingerprints (config, parameter shapes and a sample of every
weight), the device and the dtype: changed weights make a new key, so a stale curve is
never read. The ``auto`` draft budget (:mod:`speclab.decoding.budget`) reads it through
:meth:`Calibration.round_costs`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from speclab.decoding.budget import RoundCosts
from speclab.decoding.runner import ModelRunner
from speclab.forward_costs import CostCurve, CostSampler
from speclab.paths import speclab_home

#: rounds timed per point (their median is the point's cost)
CALIBRATION_REPEATS = 5
#: the default context the curves are measured on (tokens already in the cache)
DEFAULT_CONTEXT = 128


def model_fingerprint(model: torch.nn.Module) -> str:
    """A hash of ``model``'s config and attention implementation, its parameters'
    names, shapes and dtypes, and a strided sample of at most 4,096 values of each
    (weights that change change it). Not where it was loaded from: a ``models:/``
    drafter downloads to a new temporary folder each time, and with the config's
    ``_name_or_path`` in the hash no stored calibration of it was ever found again
    (every process re-measured the pair: 38 s for SmolLM2 at 16 rows)."""
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None:
        settings = {k: v for k, v in config.to_dict().items()
                    if k not in ("_name_or_path", "_commit_hash")}
        # the attention function changes the costs (gqa_attention: a several-token forward
        # of SmolLM2 at 16 rows 5x cheaper) and is not in the config's dict
        settings["attention"] = getattr(config, "_attn_implementation", None)
        h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            sample = flat[:: max(flat.numel() // 4096, 1)].double().sum().item()
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{sample!r}".encode())
    return h.hexdigest()[:16]


def calibration_key(dec) -> str:
    """The store key of a :class:`~speclab.api.Decoder`'s pair on its device and dtype."""
    parts = [model_fingerprint(dec.target.model),
             model_fingerprint(dec.draft.model) if dec.draft is not None else "-",
             str(dec.target.device), str(dec.target.dtype)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _curve(data: dict) -> CostCurve:
    return CostCurve({int(r): sorted((int(t), float(s)) for t, s in pts.items())
                      for r, pts in data.items()})


@dataclass
class Calibration:
    """A pair's measured cost curves: ``curves[model][engine]`` with model ``target`` /
    ``draft`` and engine ``single`` / ``batched``; ``meta``: device, dtype, context,
    rows, when and how long."""

    key: str
    curves: dict[str, dict[str, CostCurve]] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    @property
    def max_rows(self) -> int:
        """The largest batch the ``batched`` curves measured (1 without them)."""
        batched = self.curves.get("target", {}).get("batched")
        return max(batched.points) if batched is not None and batched.points else 1

    def round_costs(self, batched: bool) -> RoundCosts:
        """The costs the ``auto`` budget reads, for the batched engine or the one-sequence
        one."""
        engine = "batched" if batched and "batched" in self.curves["target"] else "single"
        draft = self.curves.get("draft", {}).get(engine)
        return RoundCosts(self.curves["target"][engine].cost,
                          draft.cost if draft is not None else None)

    def to_dict(self) -> dict:
        """JSON-ready: ``{key, meta, curves: {model: {engine: {rows: {tokens: s}}}}}``."""
        return {"key": self.key, "meta": self.meta,
                "curves": {m: {e: c.to_dict() for e, c in engines.items()}
                           for m, engines in self.curves.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> Calibration:
        return cls(data["key"], {m: {e: _curve(c) for e, c in engines.items()}
                                 for m, engines in data["curves"].items()}, data.get("meta", {}))


def calibration_path(key: str) -> Path:
    """Where the calibration of ``key`` is stored."""
    return speclab_home() / "calibration" / f"{key}.json"


def load_calibration(dec, rows: int = 1) -> Calibration | None:
    """The stored calibration of ``dec``'s pair on its device and dtype, when one
    covers ``rows`` rows; None otherwise (or when the file does not parse)."""
    path = calibration_path(calibration_key(dec))
    if not path.is_file():
        return None
    try:
        cal = Calibration.from_dict(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError):
        return None
    return cal if rows <= 1 or cal.max_rows >= rows else None


def calibrate(dec, max_rows: int = 1, context: int = DEFAULT_CONTEXT,
              repeats: int = CALIBRATION_REPEATS, save: bool = True) -> Calibration:
    """Measure ``dec``'s target and draft model (a :class:`~speclab.api.Decoder`): one
    row on the one-sequence runner and, when ``max_rows`` > 1, rows 1, 2, 4, ... up to
    ``max_rows`` on the batched runner, each point's median of ``repeats`` timings on
    top of ``context`` cached tokens. Saved (``save``) where :func:`load_calibration`
    finds it. ValueError naming the argument for ``max_rows`` / ``context`` /
    ``repeats`` < 1."""
    for name, v in (("max_rows", max_rows), ("context", context), ("repeats", repeats)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
    if getattr(dec, "compile", False):
        raise ValueError("compile: the compiled fast path is not calibrated (its forwards "
                         "cost less than the eager curves); calibrate without --compile")
    t0 = time.perf_counter()
    # a prefix of `context` tokens per row (the sampler's own ids): prefills of every
    # row count up to max_rows (forward_costs.prefill_shapes)
    prompts = [[0] * context] * max_rows
    cal = Calibration(calibration_key(dec))
    for engine, rows in (("single", 1), ("batched", max_rows)):
        if engine == "batched" and rows < 2:
            continue
        sampler = CostSampler(dec, prompts, 0, rows)
        for _ in range(repeats):
            sampler.round()
        model = sampler.model()
        for mid, name in model.names.items():
            cal.curves.setdefault(name, {})[engine] = model.curves[mid]
    cal.meta = {"device": str(dec.target.device), "dtype": str(dec.target.dtype),
                "context": context, "max_rows": max_rows, "repeats": repeats,
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "seconds": round(time.perf_counter() - t0, 2)}
    if save:
        path = calibration_path(cal.key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{time.monotonic_ns()}.tmp")  # per writer
        tmp.write_text(json.dumps(cal.to_dict(), indent=1))
        tmp.replace(path)
    return cal


def model_calibration(model: torch.nn.Module, max_rows: int = 1,
                      context: int = DEFAULT_CONTEXT) -> Calibration:
    """ONE model's curves (as a pair's ``target``; a Serve replica holds one side of the
    pair): the stored calibration covering ``max_rows`` rows, else measured now and
    stored."""
    alone = SimpleNamespace(target=ModelRunner(model), draft=None, compile=False)
    return load_calibration(alone, max_rows) or calibrate(alone, max_rows, context)


def format_calibration(cal: Calibration) -> str:
    """A table per model and engine: ms of a forward by rows (lines) and new tokens."""
    lines = [f"calibration {cal.key} ({cal.meta.get('device')}, {cal.meta.get('dtype')}, "
             f"context {cal.meta.get('context')}, {cal.meta.get('seconds')} s)"]
    for model, engines in cal.curves.items():
        for engine, curve in engines.items():
            tokens = sorted({t for pts in curve.points.values() for t, _ in pts})
            lines.append(f"{model} ({engine}), ms per forward; rows \\ new tokens: "
                         + " ".join(f"{t:>8}" for t in tokens))
            for r in sorted(curve.points):
                lines.append(f"  {r:>4} " + " ".join(f"{curve.cost(r, t) * 1e3:8.3f}"
                                                    for t in tokens))
    return "\n".join(lines)
