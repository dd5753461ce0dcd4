"""Resolve a ``models`` config group to local folders (building cached pairs on demand).

``reference`` -> the trained reference pair (:mod:`speclab.models.reference`);
``reference-large`` -> the memory-bound large reference target with the reference draft
(:mod:`speclab.reference_large`; ``models.dtype``: its ``run_dtype()``, bfloat16
where that is native, else float32);
``tiny`` -> random tiny models with a real BPE tokenizer (smoke runs, seconds to build);
anything else is a folder or hub id, passed through.
"""

from __future__ import annotations

from pathlib import Path

from speclab.data.corpus import read_text, split_files
from speclab.models.reference import ensure_reference_pair
from speclab.models.tiny import build_tiny_llama
from speclab.models.tokenizer import train_bpe_tokenizer
from speclab.paths import speclab_home
from speclab.reference_large import ensure_reference_large


def ensure_tiny_pair(
    root: Path | None = None, vocab_size: int = 384, seed: int = 0
) -> tuple[str, str]:
    """A 2-layer target and a close draft (a noisy copy of the target), cached.

    The draft is the target plus weight noise so that speculative decoding accepts
    drafts often, as with a trained drafter; both share a BPE tokenizer trained on a
    slice of the stdlib.
    """
    import torch
    from transformers import AutoModelForCausalLM

    out = (root or speclab_home() / "models") / f"tiny-v{vocab_size}-s{seed}"
    target, draft = out / "target", out / "draft"
    if (draft / "config.json").exists():
        return str(target), str(draft)
    tmp = out.with_name(out.name + ".partial")
    tok = train_bpe_tokenizer([read_text(split_files("train"), 300_000)], vocab_size,
                              tmp / "tokenizer")
    build_tiny_llama(tmp / "target", seed=seed, vocab_size=len(tok), hidden_size=64,
                     num_layers=2, eos_token_id=tok.eos_token_id)
    model = AutoModelForCausalLM.from_pretrained(tmp / "target", trust_remote_code=False)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2 * p.std().clamp_min(1e-3))
    model.save_pretrained(tmp / "draft")
    for d in ("target", "draft"):
        tok.save_pretrained(tmp / d)
    import shutil

    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return str(target), str(draft)


def resolve_models(target: str, draft: str | None) -> tuple[str, str | None]:
    """Folders (or hub ids) for a ``models`` config group."""
    if target == "reference":
        pair = ensure_reference_pair()
        return pair.target, draft or pair.draft
    if target == "reference-large":
        large = ensure_reference_large()
        return large.target, draft or large.draft
    if target == "tiny":
        t, d = ensure_tiny_pair()
        return t, draft or d
    return target, draft
