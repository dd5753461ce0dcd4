"""Drafters in and out: load any supported drafter folder, export one to another format.

- :func:`load_public_eagle` / :func:`load_public_medusa`: what
  :func:`~speclab.families.eagle.model.load_eagle` /
  :func:`~speclab.families.medusa.model.load_medusa` call for a folder that is not speclab's own.
- :func:`load_drafter`: any folder or ``models:/`` URI -> EagleModel, Eagle3Model or
  MedusaHeads.
- :func:`export_drafter`: ``speclab export SOURCE --format F --out DIR``.
- :func:`check_exports`: whether the formats of ``output.export`` can hold a drafter of
  a given meta (training jobs check this before any work).

=============  ==========================  ============================================
``--format``   holds                       needs
=============  ==========================  ============================================
speculators    EAGLE-1/2 drafter (vLLM,    EAGLE-1/2 layout (no input / final norm),
               ``eagle``) or EAGLE-3       one layer; EAGLE-3: three strictly ascending
               drafter (``eagle3``)        target layers, no fc bias; the target's name
                                           (verifier)
eagle          EAGLE-1/2 drafter (EAGLE    EAGLE-1/2 layout; EAGLE-3 as for speculators
               code) or EAGLE-3 drafter    (the EAGLE code itself reads the default
               (EAGLE-3 research layout)   layers; vLLM / SGLang read the named ones)
medusa         Medusa heads (also          the target's name (base_model_name_or_path)
               ``medusa_lm_head.pt``)
speclab        any (self-contained)        for a public checkpoint without an
                                           embedding / LM head: the target
=============  ==========================  ============================================

An EAGLE-3 drafter (``meta.version == 3``) is written with every tensor (embedding
included), so export then import gives the same state dict; the target's depth, when
``--target`` is a local folder or a loaded model, also refuses a feature layer that is
the target's final norm output (no public runtime captures it).
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from speclab.families.eagle.model import EagleMeta, load_eagle, save_eagle
from speclab.families.medusa.model import MedusaHeads, MedusaMeta, load_medusa, save_medusa
from speclab.models.formats.detect import (
    EAGLE,
    EAGLE3,
    EAGLE_FORMATS,
    MEDUSA,
    MEDUSA_FORMATS,
    SPECLAB_EAGLE,
    SPECLAB_MEDUSA,
    SPECULATORS,
    SPECULATORS_EAGLE3,
    check_kind,
    detect_drafter_format,
)
from speclab.models.formats.eagle_research import (
    eagle3_research_problem,
    eagle_research_problem,
    read_eagle3_research,
    read_eagle_research,
    write_eagle3_research,
    write_eagle_research,
)
from speclab.models.formats.files import DrafterFormatError, read_config, target_parts
from speclab.models.formats.medusa_format import read_medusa, write_medusa
from speclab.models.formats.speculators import (
    read_speculators,
    read_speculators_eagle3,
    speculators_eagle3_problem,
    speculators_problem,
    write_speculators_eagle3,
)

#: what ``speclab export --format`` writes
EXPORT_FORMATS = ("speculators", "eagle", "medusa", "speclab")


def _advice(folder: Path) -> str:
    return (f" (load it next to its target, e.g. speclab generate / the Python API, or make "
            f"a self-contained speclab folder first: speclab export {folder} --format speclab "
            f"--target TARGET --out DIR; a Serve draft replica holds no target weights)")


#: the reader of each public EAGLE-family format
READERS = {SPECULATORS: read_speculators, EAGLE: read_eagle_research,
           SPECULATORS_EAGLE3: read_speculators_eagle3, EAGLE3: read_eagle3_research}


def load_public_eagle(folder: str | Path, target: nn.Module | str | None = None,
                      target_config=None, field: str = "eagle_model") -> nn.Module:
    """The EAGLE-family drafter in ``folder`` (any of the EAGLE formats of
    :func:`~speclab.models.formats.detect.detect_drafter_format`: an EagleModel, or an
    Eagle3Model for EAGLE-3), float32 on the CPU. ``target``: the loaded target model or
    its folder, for the LM head (EAGLE-1/2), the embedding a checkpoint may lack, EAGLE-3's
    default target layers and the shape check; ``target_config``: the target's HF config,
    for the shape check and the default layers. Errors name the file and ``field``."""
    folder = Path(folder)
    fmt = detect_drafter_format(folder, field, "EAGLE drafter")
    check_kind(fmt, EAGLE_FORMATS, folder, field, "an EAGLE drafter")
    if fmt == SPECLAB_EAGLE:
        return load_eagle(folder, target_config, field=field)
    parts = target_parts(target, field)  # a folder / URI is loaded here
    return READERS[fmt](folder, parts, field, _advice(folder), target_config)


def load_public_medusa(folder: str | Path, target_config=None,
                       field: str = "medusa_model",
                       target: nn.Module | str | Path | None = None) -> MedusaHeads:
    """The Medusa heads in ``folder`` (speclab's or one of Medusa's formats, see
    :mod:`~speclab.models.formats.medusa_format`), float32 on the CPU, their shapes
    checked against ``target_config`` (the target's HF config) when given. ``target``
    (the loaded target model or its folder / hub id, loaded only then): the LM head of
    Medusa's legacy "version 2" heads, which have none of their own."""
    folder = Path(folder)
    fmt = detect_drafter_format(folder, field, "Medusa heads")
    check_kind(fmt, MEDUSA_FORMATS, folder, field, "Medusa heads")
    if fmt == SPECLAB_MEDUSA:
        return load_medusa(folder, field=field)
    return read_medusa(folder, target_config, field,
                       lambda: target_parts(target, field), _advice(folder))


def load_drafter(source: str | Path, target: nn.Module | str | None = None,
                 field: str = "SOURCE") -> nn.Module:
    """Any drafter: a folder in any supported format or a ``models:/`` URI (downloaded)
    -> an EagleModel, Eagle3Model or MedusaHeads (float32, CPU). ``target`` as in
    :func:`load_public_eagle` (needed for public EAGLE checkpoints without an LM head or
    embedding, and for EAGLE-3 ones that name no target layers)."""
    folder = Path(_resolve(source, field))
    fmt = detect_drafter_format(folder, field)
    if fmt in MEDUSA_FORMATS:
        config = target.config if isinstance(target, nn.Module) else None
        return load_public_medusa(folder, config, field, target)
    return load_public_eagle(folder, target, None, field)


def _resolve(source: str | Path, field: str) -> str:
    from speclab.models.loading import registry_or_folder

    return registry_or_folder(str(source), field)


def export_problem(fmt: str, meta: EagleMeta | MedusaMeta,
                   num_layers: int | None = None) -> str | None:
    """Why ``fmt`` cannot hold a drafter with ``meta`` exactly (None: it can);
    ``num_layers``: the target's depth, when known (an EAGLE-3 drafter's layers are then
    checked against it)."""
    if fmt not in EXPORT_FORMATS:
        return f"unknown format {fmt!r} (one of {list(EXPORT_FORMATS)})"
    if fmt == "speclab":
        return None
    if isinstance(meta, MedusaMeta):
        return None if fmt == MEDUSA else (f"{fmt!r} holds EAGLE drafters and these are "
                                           f"Medusa heads (their format: medusa)")
    if fmt == MEDUSA:
        return "'medusa' holds Medusa heads and this is an EAGLE drafter (its formats: " \
               "speculators, eagle, speclab)"
    if meta.version == 3:
        check = speculators_eagle3_problem if fmt == SPECULATORS else eagle3_research_problem
        return check(meta, num_layers)
    return speculators_problem(meta) if fmt == SPECULATORS else eagle_research_problem(meta)


def check_exports(formats: list[str], meta: EagleMeta | MedusaMeta,
                  field: str = "output.export", target_config=None) -> None:
    """A ValueError naming ``field`` when one of ``formats`` cannot hold a drafter with
    ``meta`` (the drafter a training job is about to train; ``target_config``: its
    target's HF config, when known: an EAGLE-3 drafter's layers are checked against the
    target's depth too)."""
    depth = None
    if target_config is not None:
        from speclab.decoding.features import num_decoder_layers

        depth = num_decoder_layers(target_config)
    for fmt in formats:
        problem = export_problem(fmt, meta, depth)
        if problem:
            raise DrafterFormatError(f"{field}: {fmt!r} cannot hold the drafter this job "
                                     f"trains: {problem}")


def export_drafter(source: str | Path, fmt: str, out: str | Path,
                   target: nn.Module | str | None = None, speculative_tokens: int = 5,
                   field: str = "SOURCE") -> Path:
    """Write the drafter of ``source`` (any supported folder or a ``models:/`` URI) to
    ``out`` in format ``fmt`` (:data:`EXPORT_FORMATS`). ``target``: the target's name or
    folder — the verifier of a speculators export, Medusa's base model, and the source
    of the LM head / embedding a public EAGLE source lacks. ``speculative_tokens``:
    speculators' ``proposal_methods[0].speculative_tokens``. A format that cannot hold
    the drafter exactly is a DrafterFormatError naming why; ``out`` must not hold files."""
    if fmt not in EXPORT_FORMATS:
        raise DrafterFormatError(f"--format: {fmt!r} is not one of {list(EXPORT_FORMATS)}")
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DrafterFormatError(f"--out: {out} exists and is not an empty folder")
    folder = Path(_resolve(source, field))
    src_fmt = detect_drafter_format(folder, field)
    drafter = load_drafter(folder, target, field)
    depth = _target_depth(target)
    problem = export_problem(fmt, drafter.meta, depth)
    if problem:
        raise DrafterFormatError(f"--format {fmt}: cannot write {source} ({src_fmt}): "
                                 f"{problem}")
    name = target if isinstance(target, str | Path) else None
    verifier = str(name) if name else _verifier_of(folder, src_fmt)
    if isinstance(drafter, MedusaHeads):
        if fmt == MEDUSA:
            return write_medusa(drafter, out, verifier)
        save_medusa(drafter, out, drafter.tree)
        return _provenance(out, src_fmt, folder, verifier)
    eagle3 = drafter.meta.version == 3
    if fmt == SPECULATORS:  # EAGLE-3 only: export_problem refused EAGLE-1/2 above
        return write_speculators_eagle3(drafter, out, verifier, _arch_of(drafter, target),
                                        speculative_tokens, num_layers=depth)
    if fmt == EAGLE:
        if eagle3:
            return write_eagle3_research(drafter, out, num_layers=depth)
        return write_eagle_research(drafter, out)
    save_eagle(drafter, out)
    return _provenance(out, src_fmt, folder, verifier)


def _target_depth(target) -> int | None:
    """The target's number of decoder layers when it is at hand (a loaded model, a
    local folder with a ``config.json``), else None (nothing is downloaded for it)."""
    from speclab.decoding.features import num_decoder_layers

    if isinstance(target, nn.Module):
        return num_decoder_layers(target.config)
    if isinstance(target, str | Path) and (Path(target) / "config.json").is_file():
        try:
            cfg = json.loads((Path(target) / "config.json").read_text())
        except ValueError:
            return None
        cfg = cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg
        for name in ("num_hidden_layers", "n_layer", "num_layers"):
            if isinstance(cfg.get(name), int):
                return int(cfg[name])
    return None


def _verifier_of(folder: Path, fmt: str) -> str | None:
    """The target a drafter folder names (speculators' verifier, Medusa's base model,
    an imported speclab drafter's provenance), or None."""
    cfg = read_config(folder, "SOURCE")
    if fmt in (SPECULATORS, SPECULATORS_EAGLE3):
        return ((cfg.get("speculators_config") or {}).get("verifier") or {}).get(
            "name_or_path")
    if fmt == MEDUSA:
        return cfg.get("base_model_name_or_path")
    if fmt == SPECLAB_MEDUSA:
        return cfg.get("target") or None
    return (cfg.get("imported_from") or {}).get("target")


def _arch_of(model: nn.Module, target) -> str:
    if model.meta.target_architecture:
        return model.meta.target_architecture
    config = getattr(target, "config", None)
    return ((getattr(config, "architectures", None) or [""])[0]) if config else ""


def _provenance(out: Path, fmt: str, folder: Path, target: str | None) -> Path:
    """Note in ``out/config.json`` where an imported drafter came from (speclab's loaders
    ignore the key; an export of it to speculators finds its target there)."""
    if fmt in (SPECLAB_EAGLE, SPECLAB_MEDUSA):
        return out
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    cfg["imported_from"] = {"format": fmt, "folder": str(folder), "target": target}
    path.write_text(json.dumps(cfg, indent=2))
    return out
