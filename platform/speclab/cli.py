"""The ``speclab`` command.

    speclab generate --target DIR --draft DIR --method salf --prompt "def f(" --json
    speclab bench [--out bench_out] [--pair reference-large] [--eagle DIR] [--medusa DIR]
                                                        # engine benchmark
    speclab shift --target DIR --method medusa ... --verify typical --temperature 0.7
                                                        # first-token TV of a relaxed rule
    speclab reference                                   # build (or find) the reference pair
    speclab reference --large                           # ... or reference-large (memory-bound)
    speclab reference --large --widen SRC --out DST     # an EAGLE / Medusa drafter for it
    speclab run <job> --config experiments/x.yaml [k=v ...]   # a job on local/embedded Ray
    speclab submit <job> --config ... [--address http://HEAD:8265] [k=v ...]
    speclab serve --config experiments/smoke/serve.yaml [k=v ...]   # HTTP app (Ray Serve)
    speclab ui [--port 5000]                            # MLflow UI over the same store

Errors in arguments or configs print one line naming the field and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys


def _knob_flags() -> dict[str, dict]:
    """One flag per knob over every registered method: ``{field: {type, help, methods}}``.
    Methods that share a knob name share its flag (same type, one meaning)."""
    from speclab.config.method import methods

    flags: dict[str, dict] = {}
    for mname, cls in methods().items():
        for field, info in cls.model_fields.items():
            if field in ("name", "label"):
                continue
            slot = flags.setdefault(field, {"annotation": info.annotation, "methods": [],
                                            "help": info.description or field,
                                            "defaults": set()})
            slot["methods"].append(mname)
            slot["defaults"].add(repr(info.default))
    return flags


def _renamed_flags() -> dict[str, dict[str, str]]:
    """Old knob name -> {method: new knob name} over every registered method."""
    from speclab.config.method import methods

    out: dict[str, dict[str, str]] = {}
    for mname, cls in methods().items():
        for old, new in cls.renamed.items():
            out.setdefault(old, {})[mname] = new
    return out


def add_method_args(p: argparse.ArgumentParser) -> None:
    """The target/draft, ``--method`` with every registered knob, the verification rule
    and the sampling flags (shared by ``generate`` and ``shift``)."""
    from speclab.config.method import methods

    p.add_argument("--target", required=True, help="target model folder or hub id")
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
    from speclab.decoding.rules.registry import rules

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


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="decode one prompt with a method of the engine",
                       description="Method knobs come from the method registry; a knob "
                                   "applies only to the methods listed in its help.")
    add_method_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", action="append",
                       help="prompt text (needs a tokenizer next to the target); repeat it to "
                            "decode several prompts together in the batched engine")
    group.add_argument("--prompt-ids", action="append",
                       help="comma-separated token ids, used as given (repeatable)")
    p.add_argument("--num-samples", type=int, default=1, help="samples; seeds seed..seed+S-1")
    p.add_argument("--batch-size", type=int, default=None,
                   help="several prompts: rows decoded at once (default: all of them)")
    p.add_argument("--compile", action="store_true",
                   help="the fast path: static KV cache + torch.compile'd forwards (each new "
                        "shape compiles once, tens of seconds on CPU)")
    p.add_argument("--json", action="store_true", help="one JSON object per sample")


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"prompt_ids: expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError("prompt_ids: must contain at least one token id")
    return ids


def method_from_args(args: argparse.Namespace):
    """The method config of ``--method`` and the knob flags given. A knob flag that the
    method does not have is refused (ValueError naming the knob and the method), as an
    ``evaluate`` config and a sweep refuse it."""
    from speclab.config.method import method_class, parse_method

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
        knobs = sorted(f for f in cls.model_fields if f != "name")
        raise ValueError(f"{foreign[0]}: not a knob of method {args.method!r} (its knobs: "
                         f"{', '.join(knobs) or 'none'}); drop "
                         f"{', '.join('--' + f.replace('_', '-') for f in foreign)}")
    return parse_method({"name": args.method, **given})


def cmd_generate(args: argparse.Namespace) -> int:
    from speclab.api import Decoder

    if args.num_samples < 1:
        raise ValueError(f"num_samples: must be >= 1, got {args.num_samples}")
    cfg = method_from_args(args)
    if cfg.needs_draft_model and not args.draft:
        raise ValueError(f"draft: method {args.method!r} needs --draft")
    prompts = ([_parse_ids(t) for t in args.prompt_ids] if args.prompt_ids is not None
               else list(args.prompt))
    if any(p == "" for p in prompts):
        raise ValueError("prompt: must not be empty")
    dec = Decoder.from_pretrained(args.target, args.draft if cfg.needs_draft_model else None,
                                  args.dtype, args.device, compile=args.compile,
                                  attn_implementation=args.attn_implementation)
    gen = {"method": cfg, "max_new_tokens": args.max_new_tokens,
           "temperature": args.temperature, "sample_top_k": args.sample_top_k,
           "top_p": args.top_p, "verify": args.verify,
           "verify_params": verify_params_from_args(args)}
    if len(prompts) > 1 or args.batch_size is not None:
        # every prompt x sample is one row of the batched engine (row i: seed + i)
        rows = [p for p in prompts for _ in range(args.num_samples)]
        results = dec.generate(prompts=rows, batch_size=args.batch_size, seed=args.seed, **gen)
        for i, res in enumerate(results):
            _print_result(res, args.json, {"prompt_index": i // args.num_samples,
                                           "seed": args.seed + i})
        b = dec.last_batch
        print(f"[batch: {len(rows)} rows, at most {b.max_batch} at once, {b.new_tokens} tokens, "
              f"{b.tokens_per_s:.1f} tokens/s, {b.target_forwards} target forwards, "
              f"{b.wall_s:.2f}s]", file=sys.stderr)
        return 0
    text, ids = (prompts[0], None) if isinstance(prompts[0], str) else (None, prompts[0])
    for s in range(args.num_samples):
        res = dec.generate(text, prompt_ids=ids, seed=args.seed + s, **gen)
        _print_result(res, args.json, {})
    return 0


def _print_result(res, as_json: bool, extra: dict) -> None:
    """One generation: a JSON line, or the text (stdout) and its stats (stderr)."""
    if as_json:
        print(json.dumps({**extra, **res.to_dict()}), flush=True)
        return
    st = res.stats
    print(res.text if res.text is not None else res.token_ids)
    print(f"[{st.new_tokens} tokens, tau={st.tau:.2f}, alpha={st.acceptance_rate:.2f}, "
          f"target calls={st.target_calls}, {st.wall_s:.2f}s]", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="speclab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    from speclab import commands

    commands.add_parsers(sub)
    args, extra = parser.parse_known_args(argv)
    if extra:  # key=value overrides may follow the options (`run`, `submit`, `serve`)
        if hasattr(args, "overrides") and all("=" in a and not a.startswith("-")
                                              for a in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    handler = cmd_generate if args.command == "generate" else commands.HANDLERS[args.command]
    try:
        return int(handler(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
