"""The ``speclab`` command.

    speclab generate --target DIR --draft DIR --method salf --prompt "def f(" --json
    speclab bench [--out bench_out] [--pair reference-large] [--eagle DIR] [--medusa DIR]
                                                        # engine benchmark
    speclab bench --pair reference-xl --device cuda --eagle SMALL_DIR   # GPU-scale target
    speclab gpu-bundle OUT --eagle DIR                  # the GPU report for an offline GPU
    speclab gpu-bundle OUT --ray                        # ... its Ray part, in 60 MB parts
    speclab shift --target DIR --method medusa ... --verify typical --temperature 0.7
                                                        # first-token TV of a relaxed rule
    speclab reference                                   # build (or find) the reference pair
    speclab reference --large                           # ... or reference-large (memory-bound)
    speclab reference --large --widen SRC --out DST     # an EAGLE / Medusa drafter for it
    speclab run <job> --config experiments/x.yaml [k=v ...]   # a job on local/embedded Ray
    speclab submit <job> --config ... [--address http://HEAD:8265] [k=v ...]
    speclab serve --config experiments/smoke/serve.yaml [k=v ...]   # HTTP app (Ray Serve)
    speclab ui [--port 5000]                            # MLflow UI over the same store
    speclab export SRC --format speculators --target T --out DIR  # EAGLE-3 drafter for vLLM
    speclab export SRC --format eagle --out DIR         # ... EAGLE layout: SGLang, EAGLE code

Errors in arguments or configs print one line naming the field and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from speclab import commands
from speclab.api import Decoder
from speclab.method_flags import _knob_flags as _knob_flags  # read by the tests
from speclab.method_flags import add_method_args, method_from_args, verify_params_from_args
from speclab.models.registry import resolve_models
from speclab.models.tokenizer import chat_ids


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
    p.add_argument("--chat", action="store_true",
                   help="render each --prompt as one user turn with the target's chat "
                        "template (the assistant's turn opened), as an instruct model expects")
    p.add_argument("--num-samples", type=int, default=1, help="samples; seeds seed..seed+S-1")
    p.add_argument("--batch-size", type=int, default=None,
                   help="several prompts: rows decoded at once (default: all of them)")
    p.add_argument("--compile", action="store_true",
                   help="the fast path: static KV cache + torch.compile'd forwards (each new "
                        "shape compiles once, tens of seconds on CPU)")
    p.add_argument("--budget", choices=["fixed", "auto"], default="fixed",
                   help="auto: each round's draft depth (0 = plain decoding) chosen from the "
                        "pair's calibrated forward costs (speclab calibrate; measured once "
                        "if missing) and the running acceptance; outputs unchanged")
    p.add_argument("--json", action="store_true", help="one JSON object per sample")


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"prompt_ids: expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError("prompt_ids: must contain at least one token id")
    return ids


def cmd_generate(args: argparse.Namespace) -> int:
    if args.num_samples < 1:
        raise ValueError(f"num_samples: must be >= 1, got {args.num_samples}")
    cfg = method_from_args(args)
    # a pair's name (reference, reference-large, tiny): its folders, its draft by default
    args.target, args.draft = resolve_models(args.target, args.draft)
    if cfg.needs_draft_model and not args.draft:
        raise ValueError(f"draft: method {args.method!r} needs --draft")
    prompts = ([_parse_ids(t) for t in args.prompt_ids] if args.prompt_ids is not None
               else list(args.prompt))
    if any(p == "" for p in prompts):
        raise ValueError("prompt: must not be empty")
    dec = Decoder.from_pretrained(args.target, args.draft if cfg.needs_draft_model else None,
                                  args.dtype, args.device, compile=args.compile,
                                  attn_implementation=args.attn_implementation)
    if args.chat:  # instruct models: the prompt as a user turn of the chat template
        if args.prompt_ids is not None:
            raise ValueError("chat: renders text prompts; --prompt-ids are used as given")
        prompts = [chat_ids(dec.tokenizer, p, "chat") for p in prompts]
    gen = {"method": cfg, "max_new_tokens": args.max_new_tokens,
           "temperature": args.temperature, "sample_top_k": args.sample_top_k,
           "top_p": args.top_p, "verify": args.verify,
           "verify_params": verify_params_from_args(args), "budget": args.budget}
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``speclab``'s command line as its subcommand's arguments (``key=value`` overrides
    after the options joined to ``overrides``); a bad line exits with status 2 and the
    usage, as argparse does."""
    parser = argparse.ArgumentParser(prog="speclab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    commands.add_parsers(sub)
    args, extra = parser.parse_known_args(argv)
    if extra:  # key=value overrides may follow the options (`run`, `submit`, `serve`)
        if hasattr(args, "overrides") and all("=" in a and not a.startswith("-")
                                              for a in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    handler = cmd_generate if args.command == "generate" else commands.HANDLERS[args.command]
    try:
        return int(handler(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
