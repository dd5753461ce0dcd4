"""The reference model pair: a small target and a much smaller draft, trained here.

Both are LLaMA-architecture models trained on the Python standard library's source
(train split) with a byte-level BPE tokenizer, deterministically (fixed seeds), in a few
minutes on 2 CPU cores. The target is deep and narrow (6 x 192) and the draft a single
narrow layer (1 x 64): on CPU a forward's cost is dominated by per-layer overhead, so
the target costs about 5-7x the draft per forward (measured: 3.2 ms vs 0.6 ms on 2
cores, see ENVIRONMENT.md) while training fast. The draft is
distilled from the target (cross-entropy mixed with word-level KD, weight 0.8), which is
how a drafter is aligned with its target in practice. The pair is cached
under ``$SPECLAB_HOME/models/reference-<hash>`` and reused.

    speclab reference          # build if missing, print the folders
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from speclab.api import Decoder
from speclab.data.corpus import function_header_prompts, read_text, split_files
from speclab.models.tiny import tiny_llama_config
from speclab.models.tokenizer import train_bpe_tokenizer
from speclab.paths import speclab_home
from speclab.train.lm import TrainSettings, eval_loss, train_causal_lm


@dataclass(frozen=True)
class ReferenceSpec:
    """Everything that determines the reference pair (its hash names the cache folder)."""

    vocab_size: int = 1024
    tokenizer_chars: int = 2_000_000
    train_chars: int = 4_000_000
    seq_len: int = 128
    target_layers: int = 6
    target_hidden: int = 192
    target_heads: int = 4
    target_steps: int = 450
    target_lr: float = 3e-3
    draft_layers: int = 1
    draft_hidden: int = 64
    draft_heads: int = 2
    draft_steps: int = 300
    draft_lr: float = 5e-3
    draft_kd_weight: float = 0.8  # word-level KD from the target aligns the drafter
    batch_size: int = 16
    seed: int = 0

    def digest(self) -> str:
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]


@dataclass(frozen=True)
class ReferencePair:
    """Folders of the target and draft (each also holds the tokenizer)."""

    target: str
    draft: str


def _log(msg: str) -> None:
    print(f"[reference] {msg}", file=sys.stderr, flush=True)


def _build_model(spec: ReferenceSpec, layers: int, hidden: int, heads: int, eos: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(spec.seed)
    cfg = tiny_llama_config(vocab_size=spec.vocab_size, hidden_size=hidden, num_layers=layers,
                            num_heads=heads, max_positions=2048, eos_token_id=eos)
    return LlamaForCausalLM(cfg)


def build_reference_pair(out: Path, spec: ReferenceSpec) -> ReferencePair:
    """Train tokenizer, target and draft into ``out`` (takes a few minutes on 2 cores)."""
    t0 = time.perf_counter()
    torch.manual_seed(spec.seed)
    train_text = read_text(split_files("train"), spec.train_chars)
    val_text = read_text(split_files("validation"), 200_000)
    tmp = out.with_name(out.name + ".partial")
    tok_dir = tmp / "tokenizer"
    tok = train_bpe_tokenizer([train_text[: spec.tokenizer_chars]], spec.vocab_size, tok_dir)
    ids = torch.tensor(tok.encode(train_text), dtype=torch.long)
    val_ids = torch.tensor(tok.encode(val_text), dtype=torch.long)
    _log(f"tokenizer: {len(tok)} tokens; train stream {ids.numel()} tokens "
         f"({time.perf_counter() - t0:.0f}s)")
    meta: dict = {"spec": asdict(spec)}
    teacher = None
    for role in ("target", "draft"):
        layers, hidden, heads = (
            getattr(spec, f"{role}_{k}") for k in ("layers", "hidden", "heads")
        )
        steps, lr = getattr(spec, f"{role}_steps"), getattr(spec, f"{role}_lr")
        model = _build_model(spec, layers, hidden, heads, tok.eos_token_id)
        kd = spec.draft_kd_weight if role == "draft" else 0.0
        settings = TrainSettings(steps=steps, batch_size=spec.batch_size, seq_len=spec.seq_len,
                                 lr=lr, seed=spec.seed, warmup=30, kd_weight=kd)
        t1 = time.perf_counter()

        def progress(step: int, loss: float, role=role, steps=steps) -> None:
            if step % 50 == 0 or step == steps - 1:
                _log(f"{role} step {step + 1}/{steps} loss {loss:.3f}")

        train_causal_lm(model, ids, settings, teacher=teacher if kd else None, on_step=progress)
        teacher = model  # the draft is distilled from the freshly trained target
        val = eval_loss(model, val_ids, spec.seq_len)
        meta[role] = {"val_loss": val, "train_s": time.perf_counter() - t1,
                      "params": sum(p.numel() for p in model.parameters())}
        _log(f"{role}: val loss {val:.3f} in {meta[role]['train_s']:.0f}s")
        model.generation_config.eos_token_id = tok.eos_token_id
        model.save_pretrained(tmp / role)
        tok.save_pretrained(tmp / role)
    meta["total_s"] = time.perf_counter() - t0
    (tmp / "reference.json").write_text(json.dumps(meta, indent=2))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    _log(f"built in {meta['total_s']:.0f}s -> {out}")
    return ReferencePair(str(out / "target"), str(out / "draft"))


def ensure_reference_pair(
    spec: ReferenceSpec | None = None, root: Path | None = None, force: bool = False
) -> ReferencePair:
    """Return the cached pair, building it first if missing (or if ``force``)."""
    spec = spec or ReferenceSpec()
    root = root or speclab_home() / "models"
    out = root / f"reference-{spec.digest()}"
    if force or not (out / "reference.json").exists():
        torch.set_num_threads(max(torch.get_num_threads(), 1))
        return build_reference_pair(out, spec)
    return ReferencePair(str(out / "target"), str(out / "draft"))


def check_reference_pair(pair: ReferencePair, num_prompts: int = 8, max_new_tokens: int = 64,
                         gamma: int = 4) -> dict:
    """Measure what the pair must provide: greedy chain acceptance alpha on held-out
    prompts (test split) and the target/draft cost ratio per single-token forward
    (timed alternately on the same context, median of 40)."""
    import statistics

    dec = Decoder.from_pretrained(pair.target, pair.draft)
    prompts = [dec.encode(p.text) for p in function_header_prompts("test", num_prompts)]
    accepted = judged = 0
    for ids in prompts:
        st = dec.generate(prompt_ids=ids, method="chain", gamma=gamma,
                          max_new_tokens=max_new_tokens).stats
        accepted += st.accepted_tokens
        judged += st.judged_tokens
    times: dict[str, list[float]] = {"target": [], "draft": []}
    context = torch.tensor(prompts[0], dtype=torch.long)
    for runner in (dec.target, dec.draft):
        runner.reset()
        runner.forward(context)
    one = torch.tensor([prompts[0][-1]], dtype=torch.long)
    for _ in range(40):
        for name, runner in (("target", dec.target), ("draft", dec.draft)):
            t0 = time.perf_counter()
            runner.forward(one)
            times[name].append(time.perf_counter() - t0)
            runner.crop(runner.length - 1)
    t_target = statistics.median(times["target"])
    t_draft = statistics.median(times["draft"])
    return {"alpha": accepted / max(judged, 1), "t_target_ms": 1e3 * t_target,
            "t_draft_ms": 1e3 * t_draft, "cost_ratio": t_target / t_draft,
            "prompts": len(prompts), "gamma": gamma}
