"""Have the target answer the user turns of conversations itself (regeneration).

    python -m jobs.regenerate --config experiments/smoke/regenerate.yaml [key=value ...]

Driver: resolves the target (``smollm2-135m``, a folder, a ``.gguf`` file, ...) and the
optional drafter, checks the chat template, then :mod:`speclab.pipelines.regenerate`
answers the conversations of ``corpus`` on Ray actors with speclab's batched engine
(``regenerate.method``: plain decoding, or a drafting method whose speed-up the job
reports as target calls per token), writing resumable shards and a manifest to
``regenerate.output``. Train on the result with ``corpus: {source: conversations,
path: <that folder>}``. MLflow gets the settings, the totals and the manifest.
"""

from __future__ import annotations

import json
from pathlib import Path

from speclab.config import RegenerateJob
from speclab.data.token_stream import chat_template_of
from speclab.models.loading import load_tokenizer, resolve_source
from speclab.models.registry import resolve_models
from speclab.paths import speclab_home
from speclab.pipelines.cli import start_job
from speclab.pipelines.regenerate import MANIFEST, check_output, run, settings_of
from speclab.raylib import init_ray


def prepare(cfg: RegenerateJob) -> tuple[str, str | None, Path]:
    """(target folder, draft folder or None, output folder); ValueError on bad input."""
    if cfg.corpus.source != "conversations":
        raise ValueError("corpus.source: the regenerate job reads conversations, got "
                         f"{cfg.corpus.source!r}")
    needs_draft = cfg.regenerate.method.needs_draft_model
    target, draft = resolve_models(cfg.models.target, cfg.models.draft if needs_draft else None)
    if needs_draft and draft is None:
        raise ValueError(f"models.draft: method {cfg.regenerate.method.name!r} needs a draft "
                         "model")
    target = resolve_source(target, "models.target")
    draft = resolve_source(draft, "models.draft") if draft else None
    tok = load_tokenizer(target, field="models.target")
    if not chat_template_of(cfg.corpus) and not getattr(tok, "chat_template", None):
        raise ValueError("corpus.chat_template: the target's tokenizer has no chat template; "
                         "give one")
    out = Path(cfg.regenerate.output or speclab_home() / "data" / "regenerated" / cfg.name)
    out = out.expanduser().resolve()
    check_output(out, settings_of(cfg, target))  # before any work
    return target, draft, out


def main(argv: list[str] | None = None) -> int:
    job = start_job("regenerate", __doc__, argv, prepare)
    cfg, tracker, (target, draft, out) = job.cfg, job.tracker, job.inputs
    where = init_ray(job.address, cfg.ray.num_cpus)
    print(f"[regenerate] running on {where}; target {target}, method "
          f"{cfg.regenerate.method.name} -> {out}", flush=True)
    with tracker as t:
        t.set_tags({"job": "regenerate", "output": str(out), "target": target})
        totals = run(cfg, target, draft, out)
        t.log_metrics({k: float(v) for k, v in totals.items()})
        t.log_text((out / MANIFEST).read_text(), MANIFEST)
    print(f"[regenerate] {totals['answers']} answers, {totals['new_tokens']} tokens in "
          f"{totals['seconds']:.0f}s ({totals['tokens_per_s']:.1f} tokens/s, "
          f"{totals['target_calls_per_token']:.3f} target calls per token, "
          f"{totals['capped']} answers capped at {cfg.regenerate.max_new_tokens} tokens, "
          f"{totals['too_long']} turns too long for the target's context): {out}", flush=True)
    whole = json.loads((out / MANIFEST).read_text())["all_shards"]
    print(f"[regenerate] in all {whole['shards']} shards: {whole['answers']} answers, "
          f"{whole['new_tokens']} tokens in {whole['seconds']:.0f}s of decoding "
          f"({whole['tokens_per_s']:.1f} tokens/s, {whole['target_calls_per_token']:.3f} "
          "target calls per token), over every run that wrote them", flush=True)
    return 0
