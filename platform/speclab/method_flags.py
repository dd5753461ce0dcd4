"""The method flags of the ``speclab`` commands that decode with a method (``generate``,
``shift``): the target / draft, ``--method`` with one flag per knob of every registered
method, the verification rule and the sampling flags, and the method config they give."""

from __future__ import annotations

import argparse

from speclab.config.method import method_class, methods, parse_method
from speclab.decoding.rules.registry import rules


def _knob_flags() -> dict[str, dict]:
    """One flag per knob over every registered method: ``{field: {type, help, methods}}``.
    Methods that share a knob name share its flag (same type, one meaning)."""
    flags: dict[str, dict] = {}
    for mname, cls in methods().items():
        for field, info in cls.model_fields.items():
            if field in cls.META:  # --budget is generate's own flag
                continue
            slot = flags.setdefault(field, {"annotation": info.annotation, "methods": [],
                                            "help": info.description or field,
                                            "defaults": set()})
            slot["methods"].append(mname)
            slot["defaults"].add(repr(info.default))
    return flags


def _renamed_flags() -> dict[str, dict[str, str]]:
    """Old knob name -> {method: new knob name} over every registered method."""
    out: dict[str, dict[str, str]] = {}
    for mname, cls in methods().items():
        for old, new in cls.renamed.items():
            out.setdefault(old, {})[mname] = new
    return out


def add_method_args(p: argparse.ArgumentParser) -> None:
    """The target/draft, ``--method`` with every registered knob, the verification rule
    and the sampling flags (shared by ``generate`` and ``shift``)."""
    p.add_argument("--target", required=True,
                   help="target model: a folder, hub id, models:/ URI, .gguf file, a real "
                        "model's name (smollm2-135m) or a pair's (reference, "
                        "reference-large, tiny: its draft is the default --draft)")
    p.add_argument("--draft", help="draft model folder or hub id (methods with a draft LM)")
    p.add_argument("--method", default="chain", choices=list(methods()))
    knobs = p.add_argument_group("method knobs (default: the method's own default)")
    for field, slot in _knob_flags().items():
        flag = "--" + field.replace("_", "-")
        default = "/".join(sorted(slot["defaults"]))
        helptext = f"{slot['help']} [{', '.join(slot['methods'])}; default {default}]"
        if slot["annotation"] is bool:
            knobs.add_argument(flag, dest=field, action=argparse.BooleanOptionalAction,
                               default=None, help=helptext)
        else:
            kind = slot["annotation"] if slot["annotation"] in (int, float) else str
            knobs.add_argument(flag, dest=field, type=kind, default=None, help=helptext)
    for old in _renamed_flags():  # old knob names: refused, naming the new flag
        p.add_argument("--" + old.replace("_", "-"), dest=f"renamed_{old}", default=None,
                       help=argparse.SUPPRESS)
    p.add_argument("--verify", metavar="RULE",
                   help=f"the verification rule, from the rule registry: {_rule_help()} "
                        "(default: greedy at temperature 0, sample otherwise)")
    p.add_argument("--verify-param", action="append", default=[], metavar="KEY=VALUE",
                   help="a parameter of the rule (see --verify for each rule's parameters "
                        "and defaults), e.g. --verify-param epsilon=0.2 (typical)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sample-top-k", type=int, default=0, help="top-k filter of the sampler")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--attn-implementation", default="auto",
                   help="auto (sdpa where the model supports it, else eager), sdpa or eager")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")


def _rule_help() -> str:
    """Every registered rule (plugin modules included) with its parameters' defaults."""
    try:
        known = rules()
    except ImportError as err:  # a plugin module that does not import: reported when used
        return f"(the rule registry failed to load: {err})"
    out = []
    for name, rule in known.items():
        params = ", ".join(f"{k}={f.default}" for k, f in rule.params.model_fields.items())
        detail = "; ".join(filter(None, [rule.doc, params]))
        out.append(f"{name} ({detail})" if detail else name)
    return " | ".join(out).replace("%", "%%")  # argparse formats help with %


def verify_params_from_args(args: argparse.Namespace) -> dict | None:
    """``--verify-param KEY=VALUE`` flags as ``{key: value}`` (None when none given); the
    values (numbers, else strings) are validated by the rule's own parameter model."""
    out: dict = {}
    for item in args.verify_param:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"verify_params: expected KEY=NUMBER (or KEY=TEXT), got {item!r}")
        for kind in (int, float, str):
            try:
                out[key.strip()] = kind(value)
                break
            except ValueError:
                continue
    return out or None


def method_from_args(args: argparse.Namespace):
    """The method config of ``--method`` and the knob flags given. A knob flag that the
    method does not have is refused (ValueError naming the knob and the method), as an
    ``evaluate`` config and a sweep refuse it."""
    cls = method_class(args.method)
    for old, new in _renamed_flags().items():
        if getattr(args, f"renamed_{old}", None) is not None:
            target = new.get(args.method)
            hint = (f"--{target.replace('_', '-')}" if target else
                    " / ".join(f"--{n.replace('_', '-')} ({m})" for m, n in new.items()))
            raise ValueError(f"{old}: renamed: use {hint} instead")
    given = {f: getattr(args, f) for f in _knob_flags() if getattr(args, f, None) is not None}
    foreign = sorted(f for f in given if f not in cls.model_fields)
    if foreign:
        knobs = sorted(f for f in cls.model_fields if f not in cls.META)
        raise ValueError(f"{foreign[0]}: not a knob of method {args.method!r} (its knobs: "
                         f"{', '.join(knobs) or 'none'}); drop "
                         f"{', '.join('--' + f.replace('_', '-') for f in foreign)}")
    return parse_method({"name": args.method, **given})
