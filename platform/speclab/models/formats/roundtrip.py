"""Export a drafter to public formats, load each export back, and decode with every copy.

``python -m speclab.models.formats.roundtrip DRAFTER --target TARGET [--formats
speculators eagle] [--prompts 8] [--max-new-tokens 64] [--json OUT]``

For each format: :func:`~speclab.models.formats.convert.export_drafter` writes the
drafter, :func:`~speclab.models.formats.convert.load_drafter` reads it back (the path
``--eagle-model DIR`` takes), and the largest difference of any parameter against the
source is reported. Then greedy decoding with ``method: eagle`` on held-out chat prompts
(the ``test`` split of ShareGPT, through the target's chat template; ``--prompts-from``
another conversation source) runs once per copy; a copy passes when every output AND
every round's accepted length equal the source drafter's. Prints a table, exits 0 when
all pass, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch


def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """The largest ``|a - b|`` over parameters and buffers both modules hold by name
    (float32); ``inf`` when their names or shapes differ."""
    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys() or any(sa[k].shape != sb[k].shape for k in sa):
        return float("inf")
    return max((float((sa[k].float() - sb[k].float()).abs().max()) for k in sa
                if sa[k].numel()), default=0.0)


def held_out_prompts(tokenizer, source: str, n: int) -> list[list[int]]:
    """``n`` held-out conversations' first user turns of ``source`` (a conversation
    source, :mod:`speclab.data.conversations`) through the tokenizer's chat template ->
    token ids, one list per prompt."""
    from speclab.data.prompts import chat_prompts

    data = SimpleNamespace(prompts="conversations", path=source, num_prompts=n, turns=1,
                           chat_template=None)
    return list(chat_prompts(data, tokenizer))


def roundtrip(drafter: str, target: str, formats: list[str], prompts: list[list[int]],
              max_new_tokens: int, out: Path, **knobs) -> list[dict]:
    """Rows (one per copy: the source first, then each format) with the parameter
    difference, the outputs' and accepted lengths' agreement with the source, tau."""
    from speclab.api import Decoder
    from speclab.models.formats.convert import export_drafter, load_drafter

    dec = Decoder.from_pretrained(target)
    source = load_drafter(drafter, dec.target.model)
    copies = [("source", str(drafter))]
    for fmt in formats:
        folder = out / fmt
        export_drafter(drafter, fmt, folder, target=target)
        copies.append((fmt, str(folder)))
    rows, reference = [], None
    for name, folder in copies:
        loaded = load_drafter(folder, dec.target.model)
        results = [dec.generate(prompt_ids=p, method="eagle", eagle_model=folder,
                                max_new_tokens=max_new_tokens, **knobs) for p in prompts]
        runs = [(r.token_ids, list(r.stats.round_accepted)) for r in results]
        reference = reference or runs
        accepted = sum(sum(a) for _, a in runs)
        rounds = sum(len(a) for _, a in runs)
        rows.append({"copy": name, "folder": folder,
                     "max_param_diff": max_param_diff(source, loaded),
                     "outputs_equal": sum(r[0] == s[0] for r, s in zip(runs, reference)),
                     "accepted_equal": sum(r[1] == s[1] for r, s in zip(runs, reference)),
                     "prompts": len(runs),
                     "tau": (accepted + rounds) / max(rounds, 1)})
    return rows


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m speclab.models.formats.roundtrip",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("drafter", help="an EAGLE drafter folder or models:/ URI")
    ap.add_argument("--target", required=True, help="the target (name, folder, GGUF, URI)")
    ap.add_argument("--formats", nargs="+", default=["speculators", "eagle"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompts-from", default="sharegpt",
                    help="conversation source of the held-out prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", help="folder for the exports (default: a temporary one)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    from speclab.models.loading import load_tokenizer, resolve_source

    tok = load_tokenizer(resolve_source(args.target, "--target"), "--target")
    prompts = held_out_prompts(tok, args.prompts_from, args.prompts)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out) if args.out else Path(tmp)
        rows = roundtrip(args.drafter, args.target, args.formats, prompts,
                         args.max_new_tokens, out)
    print(f"{'copy':<12} {'max |param diff|':>16} {'outputs equal':>14} "
          f"{'accepted equal':>15} {'tau':>6}")
    for r in rows:
        print(f"{r['copy']:<12} {r['max_param_diff']:>16.3g} "
              f"{r['outputs_equal']:>9}/{r['prompts']:<4} "
              f"{r['accepted_equal']:>10}/{r['prompts']:<4} {r['tau']:>6.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    ok = all(r["max_param_diff"] == 0.0 and r["outputs_equal"] == r["prompts"]
             and r["accepted_equal"] == r["prompts"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
