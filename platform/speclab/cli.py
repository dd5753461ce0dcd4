"""The ``speclab`` command.

    speclab generate --target DIR --draft DIR --method salf --prompt "def f(" --json
    speclab bench [--out bench_out] [--quick]          # engine benchmark on the reference pair
    speclab reference                                   # build (or find) the reference pair
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


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="decode one prompt with a method of the engine")
    p.add_argument("--target", required=True, help="target model folder or hub id")
    p.add_argument("--draft", help="draft model folder or hub id (not needed for ar)")
    p.add_argument("--method", default="chain",
                   choices=["ar", "chain", "tree", "optimal", "salf", "specdecpp", "pld",
                            "rest", "aasd"])
    p.add_argument("--gamma", type=int, default=4, help="chain draft length")
    p.add_argument("--top-k", type=int, default=4, help="EAGLE-2 children per node / beam")
    p.add_argument("--depth", type=int, default=5, help="maximum draft depth (trees)")
    p.add_argument("--nodes", type=int, default=16, help="draft nodes per tree")
    p.add_argument("--batch", type=int, default=4, help="nodes expanded per draft forward")
    p.add_argument("--threshold", type=float, default=0.3,
                   help="SALF threshold / SpecDec++ stop threshold h, in (0, 1)")
    p.add_argument("--head", help="SpecDec++ acceptance head folder or models:/ URI")
    p.add_argument("--max-draft", type=int, default=20, help="SpecDec++ draft length cap")
    p.add_argument("--ngram", type=int, default=10, help="PLD/REST/AASD draft tokens per n-gram")
    p.add_argument("--max-key", type=int, default=3, help="PLD/REST/AASD longest lookup key")
    p.add_argument("--candidates", type=int, default=1, help="PLD/REST/AASD n-grams per round")
    p.add_argument("--datastore", help="REST datastore folder (jobs/build_datastore.py)")
    p.add_argument("--align-k", type=int, default=2, help="AASD alignment-sampled tokens")
    p.add_argument("--no-conditional", action="store_true",
                   help="AASD without conditional verification (strict)")
    p.add_argument("--aasd-alpha", type=float, default=0.1, help="AASD alpha (eq. 5)")
    p.add_argument("--aasd-beta", type=float, default=0.1, help="AASD beta (eq. 5)")
    p.add_argument("--score-temperature", type=float, default=1.0,
                   help="temperature of the draft softmax that ranks tree nodes")
    p.add_argument("--verify", choices=["greedy", "sample", "typical"],
                   help="default: greedy at temperature 0, sample otherwise")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sample-top-k", type=int, default=0, help="top-k filter of the sampler")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="prompt text (needs a tokenizer next to the target)")
    group.add_argument("--prompt-ids", help="comma-separated token ids, used as given")
    p.add_argument("--num-samples", type=int, default=1, help="samples; seeds seed..seed+S-1")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
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
    from speclab.api import NO_DRAFT_MODEL, Decoder

    if args.num_samples < 1:
        raise ValueError(f"num_samples: must be >= 1, got {args.num_samples}")
    if args.method not in NO_DRAFT_MODEL and not args.draft:
        raise ValueError(f"draft: method {args.method!r} needs --draft")
    ids = _parse_ids(args.prompt_ids) if args.prompt_ids is not None else None
    if args.prompt is not None and not args.prompt:
        raise ValueError("prompt: must not be empty")
    dec = Decoder.from_pretrained(args.target,
                                  None if args.method in NO_DRAFT_MODEL else args.draft,
                                  args.dtype, args.device)
    for s in range(args.num_samples):
        res = dec.generate(
            args.prompt, prompt_ids=ids, method=args.method,
            max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_k_sampling=args.sample_top_k, top_p=args.top_p, verify=args.verify,
            seed=args.seed + s, gamma=args.gamma, top_k=args.top_k, depth=args.depth,
            nodes=args.nodes, batch=args.batch, threshold=args.threshold,
            score_temperature=args.score_temperature, head=args.head,
            max_draft=args.max_draft, ngram=args.ngram, max_key=args.max_key,
            candidates=args.candidates, datastore=args.datastore, align_k=args.align_k,
            conditional=not args.no_conditional, aasd_alpha=args.aasd_alpha,
            aasd_beta=args.aasd_beta,
        )
        if args.json:
            print(json.dumps(res.to_dict()), flush=True)
        else:
            st = res.stats
            print(res.text if res.text is not None else res.token_ids)
            print(f"[{st.new_tokens} tokens, tau={st.tau:.2f}, alpha={st.acceptance_rate:.2f}, "
                  f"target calls={st.target_calls}, {st.wall_s:.2f}s]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="speclab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    from speclab import commands

    commands.add_parsers(sub)
    args = parser.parse_args(argv)
    handler = cmd_generate if args.command == "generate" else commands.HANDLERS[args.command]
    try:
        return int(handler(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
