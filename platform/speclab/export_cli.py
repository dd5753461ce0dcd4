"""``speclab export SOURCE --format speculators|eagle|medusa|speclab --out DIR``: a drafter
(speclab's folder, a public checkpoint or a ``models:/`` URI) written in another format
(:func:`speclab.models.formats.export_drafter`), then how the runtimes that read that
format serve it (:func:`serve_hints`).

Which runtime reads what (checked by tests/unit/test_interop_runtimes.py):

- ``speculators`` (an EAGLE-3 drafter, ``speculators_model_type: eagle3``): speculators'
  own ``SpeculatorModel.from_pretrained``; vLLM, which reads ``speculators_config`` of the
  folder it is given (``vllm serve DIR``: the verifier it names is the served model, the
  method and the number of speculative tokens come from the config) or of the draft
  model of ``--speculative-config``.
- ``eagle`` (the EAGLE authors' research layout, EAGLE-1/2 or EAGLE-3): the EAGLE code
  (``EaModel.from_pretrained``) and SGLang (``--speculative-draft-model-path``; its
  EAGLE-1/2 ``fc`` always has a bias, so an EAGLE-1/2 drafter without one is the EAGLE
  code's only).
- ``medusa`` (heads-only ``medusa_lm_head.pt``): Medusa's loaders; with other than 5
  heads a warning (:func:`medusa_hints`): ``medusa_model.py``'s fallback for a heads-only
  folder builds 5 heads whatever ``medusa_num_heads`` says.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from speclab.models.formats.convert import EXPORT_FORMATS
from speclab.models.formats.detect import EAGLE, MEDUSA, SPECULATORS, eagle3_config


def add_export_parser(sub, handlers: dict) -> None:
    """Register ``export`` on an argparse subparsers object (its handler in ``handlers``)."""
    p = sub.add_parser(
        "export", help="write a drafter (EAGLE-family or Medusa) in another format: "
                       "speculators (EAGLE-3: vLLM, speculators), eagle (EAGLE research "
                       "layout: SGLang, the EAGLE code), medusa, speclab")
    p.add_argument("source", metavar="SOURCE",
                   help="drafter folder (speclab, EAGLE-1/2 / HASS, speculators, Medusa) or "
                        "models:/ URI")
    p.add_argument("--format", required=True, choices=EXPORT_FORMATS, dest="fmt",
                   help="speculators: an EAGLE-3 drafter for vLLM (vllm serve DIR) and "
                        "speculators; eagle: the EAGLE authors' layout (EAGLE-1/2 or "
                        "EAGLE-3) for SGLang and the EAGLE code; medusa: Medusa heads; "
                        "speclab: speclab's self-contained folder")
    p.add_argument("--out", required=True, help="new (or empty) folder")
    p.add_argument("--target", default=None,
                   help="the target's name or folder: speculators' verifier / Medusa's base "
                        "model, and the LM head (and embedding) a public EAGLE source lacks")
    p.add_argument("--speculative-tokens", type=int, default=5,
                   help="speculators: proposal_methods[0].speculative_tokens (vLLM's "
                        "num_speculative_tokens when it serves the folder)")
    handlers["export"] = cmd_export


#: the number of heads Medusa's ``medusa_model.py`` builds for a heads-only folder
MEDUSA_FALLBACK_HEADS = 5


def medusa_hints(cfg: dict) -> list[str]:
    """A warning line when a Medusa export's ``config.json`` (``cfg``) has other than
    :data:`MEDUSA_FALLBACK_HEADS` heads: FasterDecoding/Medusa's
    ``medusa/model/medusa_model.py`` (``MedusaModel.from_pretrained``, what its CLI uses)
    reads a heads-only folder through its fallback (``AutoConfig`` fails on a config
    without ``model_type``), which sets ``medusa_num_heads = 5`` whatever the file says
    and loads ``medusa_lm_head.pt`` with ``strict=False``; ``medusa_model_legacy.py``
    reads ``medusa_num_heads`` from the config (or takes it as an argument). [] else."""
    k = cfg.get("medusa_num_heads")
    if not isinstance(k, int) or k == MEDUSA_FALLBACK_HEADS:
        return []
    n = MEDUSA_FALLBACK_HEADS
    lo, hi = (k, n - 1) if k < n else (n, k - 1)
    one = lo == hi
    heads = f"head {lo}" if one else f"heads {lo}..{hi}"
    what = (f"{heads} {'stays' if one else 'stay'} randomly initialised and "
            f"{'is' if one else 'are'} used" if k < n
            else f"{heads} {'is' if one else 'are'} dropped")
    return [f"warning: medusa_num_heads={k}: Medusa's medusa.model.medusa_model.MedusaModel."
            f"from_pretrained (its CLI's loader) builds {n} heads for a heads-only folder "
            f"whatever config.json says and loads medusa_lm_head.pt with strict=False, so "
            f"{what}; load it with medusa.model.medusa_model_legacy.MedusaModel."
            f"from_pretrained(DIR) (LLaMA targets), which builds medusa_num_heads={k} heads "
            f"from config.json (or pass medusa_num_heads={k} to it)"]


def serve_hints(fmt: str, out: Path, target: str | None = None) -> list[str]:
    """The commands that serve the export in ``out`` (format ``fmt``), read from its
    ``config.json``; ``target``: the ``--target`` given (else the verifier the config
    names, or TARGET); for ``medusa``, the warning of :func:`medusa_hints`. [] for
    formats without a serving runtime to name."""
    path = Path(out) / "config.json"
    if fmt not in (SPECULATORS, EAGLE, MEDUSA) or not path.is_file():
        return []
    cfg = json.loads(path.read_text())
    if fmt == MEDUSA:
        return medusa_hints(cfg)
    if fmt == SPECULATORS:
        spec = cfg.get("speculators_config") or {}
        verifier = (spec.get("verifier") or {}).get("name_or_path") or target or "TARGET"
        method = cfg.get("speculators_model_type", "eagle3")
        methods = spec.get("proposal_methods") or [{}]
        n = methods[0].get("speculative_tokens", 5)
        draft = json.dumps({"model": str(out), "method": method, "num_speculative_tokens": n})
        named = f"vllm serve {verifier} --speculative-config '{draft}'"
        if Path(verifier).expanduser().exists():  # vLLM reads a hub id there, not a folder
            return [f"serve it with vLLM naming the target: {named} (`vllm serve {out}` "
                    f"alone needs speculators_config.verifier.name_or_path to be a hub id; "
                    f"this one is the local folder {verifier})"]
        return [f"serve it with vLLM (it reads speculators_config: serves the verifier "
                f"{verifier} with this {method} drafter, {n} speculative tokens): "
                f"vllm serve {out}",
                f"  or naming the target: {named}"]
    eagle3 = eagle3_config(cfg)
    name = target or "TARGET"
    code = (f"EaModel.from_pretrained(base_model_path={name!r}, ea_model_path={str(out)!r}, "
            f"use_eagle3={eagle3})")
    if not eagle3 and cfg.get("bias", True) is False:
        # SGLang's EAGLE-1/2 fc (llama_eagle.py) always has a bias, left at its initial
        # value when the file has none: only the EAGLE code reads this drafter exactly
        return [f"run it with the EAGLE code: {code} (SGLang's EAGLE-1/2 fc always has a "
                f"bias, which this drafter's has not)"]
    algorithm = "EAGLE3" if eagle3 else "EAGLE"
    return [f"serve it with SGLang: python -m sglang.launch_server --model-path {name} "
            f"--speculative-algorithm {algorithm} --speculative-draft-model-path {out}",
            f"  or with the EAGLE code: {code}"]


def cmd_export(args: argparse.Namespace) -> int:
    """Export, then print where and how the result is served."""
    from speclab.models.formats import export_drafter

    out = export_drafter(args.source, args.fmt, args.out, target=args.target,
                         speculative_tokens=args.speculative_tokens)
    print(f"wrote {args.fmt} drafter to {out}")
    for line in serve_hints(args.fmt, out, args.target):
        print(line)
    return 0
