"""``speclab export SOURCE --format speculators|eagle|medusa|speclab --out DIR``: a drafter
(speclab's folder, a public checkpoint or a ``models:/`` URI) written in another format
(:func:`speclab.models.formats.export_drafter`)."""

from __future__ import annotations

import argparse

from speclab.models.formats.convert import EXPORT_FORMATS


def add_export_parser(sub, handlers: dict) -> None:
    """Register ``export`` on an argparse subparsers object (its handler in ``handlers``)."""
    p = sub.add_parser(
        "export", help="write a drafter (EAGLE-family or Medusa) in another format: "
                       "speculators (vLLM), eagle (EAGLE research code), medusa, speclab")
    p.add_argument("source", metavar="SOURCE",
                   help="drafter folder (speclab, EAGLE-1/2 / HASS, speculators, Medusa) or "
                        "models:/ URI")
    p.add_argument("--format", required=True, choices=EXPORT_FORMATS, dest="fmt")
    p.add_argument("--out", required=True, help="new (or empty) folder")
    p.add_argument("--target", default=None,
                   help="the target's name or folder: speculators' verifier / Medusa's base "
                        "model, and the LM head (and embedding) a public EAGLE source lacks")
    p.add_argument("--speculative-tokens", type=int, default=5,
                   help="speculators: proposal_methods[0].speculative_tokens (vLLM's default "
                        "num_speculative_tokens)")
    handlers["export"] = cmd_export


def cmd_export(args: argparse.Namespace) -> int:
    """Export, then print where and how the result is served."""
    from speclab.models.formats import export_drafter

    out = export_drafter(args.source, args.fmt, args.out, target=args.target,
                         speculative_tokens=args.speculative_tokens)
    print(f"wrote {args.fmt} drafter to {out}")
    if args.fmt == "speculators":
        print(f"serve it with vLLM: vllm serve {out}")
    return 0
