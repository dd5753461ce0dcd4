"""Distil a drafter for a target: generate the target's signals on Ray actors, train the
drafter with Ray Train, register it in MLflow and evaluate it with the engine.

    python -m jobs.distill --config experiments/smoke/distill.yaml [key=value ...]

Stage 1, generate: the corpus (tokenised with the target's tokenizer) is cut into
deterministic windows; target replicas on Ray actors turn them into what the losses
need (``distill.loss``; see :mod:`speclab.train.distill_data`) and write Parquet shards
``<run>/data/<kind>/shard-NNNNN.parquet`` one at a time (written to a temporary name,
then renamed, so a shard is either whole or absent). Shards already present are not
regenerated, so a rerun with ``train.resume=true`` resumes generation too.
Stage 2, train: a LLaMA drafter (``arch``, sharing the target's tokenizer) is trained on
the shards with Ray Train (same loop, checkpoints and FailureConfig as train_target).
Then the drafter is saved, registered (``output.register_as``) and evaluated against the
target (``methods``, ``data``, ``decoding``) in the same MLflow run (metrics ``eval/...``).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jobs  # noqa: F401  (makes speclab importable from a plain checkout)
from jobs._cli import run_dirs, start_job
from speclab.config import ExperimentConfig


def plan_starts(cfg: ExperimentConfig, tokens, kind: str) -> tuple[list[int], int]:
    """Deterministic corpus offsets and length of ``kind``'s inputs (windows / prompts /
    contexts); the inputs themselves are sliced per shard, so memory stays bounded."""
    import torch

    d = cfg.distill
    length = {"kd": d.seq_len + 1, "seq": d.prompt_len, "tree": d.context_len,
              "accept": d.prompt_len}[kind]
    if tokens.numel() <= length + 1:
        raise ValueError(f"corpus: too little text for {kind} examples of {length} tokens")
    g = torch.Generator().manual_seed(cfg.train.seed + 7919 * len(kind))
    starts = torch.randint(0, tokens.numel() - length - 1, (d.examples,), generator=g)
    return starts.tolist(), length


def generate(cfg: ExperimentConfig, target: str, data_dir: Path, kinds: set[str],
             tokens, draft: str | None = None) -> tuple[dict[str, int], float]:
    """Stage 1 on an actor pool; returns (shards per kind, the actors' peak RSS in MB).

    The ``accept`` kind (SpecDec++ head data) also needs the local ``draft`` folder."""
    if "accept" in kinds and draft is None:
        raise ValueError("models.draft: acceptance-head data needs a drafter")
    import ray

    d = cfg.distill
    device = "cuda" if d.gen_gpus_per_actor > 0 else cfg.models.device
    dtype = cfg.models.dtype

    @ray.remote
    class Generator:
        """Holds one target replica; turns example inputs into Parquet shards."""

        def __init__(self) -> None:
            from speclab.api import Decoder

            self.dec = Decoder.from_pretrained(target, draft, dtype, device)

        def shard(self, kind: str, inputs: list[list[int]], path: str, first: int) -> float:
            """Write one shard; returns this actor's peak RSS in MB."""
            import os
            import resource

            import pyarrow as pa
            import pyarrow.parquet as pq

            from speclab.train import distill_data as dd

            runner, eos = self.dec.target, self.dec.eos_token_id
            if kind == "kd":
                rows = [dd.kd_example(runner, x, d.top_k) for x in inputs]
            elif kind == "seq":
                rows = [dd.seq_example(runner, x, d.response_len, eos) for x in inputs]
            elif kind == "accept":
                rows = [dd.accept_example(runner, self.dec.draft, x, d.response_len,
                                          cfg.head.temperature, cfg.train.seed + first + j,
                                          eos) for j, x in enumerate(inputs)]
            else:
                rows = [dd.tree_example(runner, x, d.tree_top_k, d.tree_depth, d.tree_nodes,
                                        d.top_k) for x in inputs]
            tmp = path + ".tmp"
            pq.write_table(pa.Table.from_pylist(rows), tmp)
            os.replace(tmp, path)  # atomic: a shard is whole or absent
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    pool = [Generator.options(num_cpus=d.gen_cpus_per_actor,
                              num_gpus=d.gen_gpus_per_actor).remote()
            for _ in range(d.gen_actors)]
    pending, written, submitted, peak = [], {}, 0, 0.0
    try:
        for kind in sorted(kinds):
            folder = data_dir / kind
            folder.mkdir(parents=True, exist_ok=True)
            starts, length = plan_starts(cfg, tokens, kind)
            n_shards = (len(starts) + d.shard_size - 1) // d.shard_size
            written[kind] = n_shards
            for i in range(n_shards):
                path = folder / f"shard-{i:05d}.parquet"
                if path.exists():
                    continue  # resumed generation: finished shards are kept
                chunk = [tokens[s : s + length].tolist()
                         for s in starts[i * d.shard_size : (i + 1) * d.shard_size]]
                if len(pending) >= 2 * len(pool):  # bounded number of shards in flight
                    done, pending = ray.wait(pending, num_returns=1)
                    peak = max(peak, *ray.get(done))
                pending.append(pool[submitted % len(pool)].shard.remote(
                    kind, chunk, str(path), i * d.shard_size))
                submitted += 1
        peak = max(peak, *ray.get(pending)) if pending else peak
    finally:
        for a in pool:
            ray.kill(a)
    return written, peak


@dataclass
class Prepared:
    """Inputs checked and loaded on the driver before any Ray work."""

    target: str
    tokenizer: object
    tokens: object  # 1-D LongTensor of the tokenised training corpus
    vocab: int
    eos: int | None


def prepare(cfg: ExperimentConfig) -> Prepared:
    """Resolve the target, check tokenizer/vocabulary, load the corpus (ValueError if bad)."""
    import torch
    from transformers import AutoTokenizer

    from speclab.data.text import load_corpus
    from speclab.models.loading import load_model, resolve_source
    from speclab.models.registry import resolve_models

    target, _ = resolve_models(cfg.models.target, None)
    target = resolve_source(target, "models.target")  # models:/ URIs -> a local folder
    target_cfg = load_model(target, field="models.target").config
    tok = AutoTokenizer.from_pretrained(target)
    if cfg.tokenizer.path:
        other = AutoTokenizer.from_pretrained(cfg.tokenizer.path)
        if len(other) != len(tok):
            raise ValueError(f"tokenizer.path: vocabulary of {len(other)} tokens does not "
                             f"match the target's tokenizer ({len(tok)} tokens)")
    if len(tok) > target_cfg.vocab_size:
        raise ValueError(f"models.target: tokenizer has {len(tok)} tokens but the model's "
                         f"vocab_size is {target_cfg.vocab_size}")
    train_text, _ = load_corpus(cfg.corpus.source, cfg.corpus.path, cfg.corpus.max_chars,
                                cfg.corpus.val_chars, cfg.corpus.text_field)
    tokens = torch.tensor(tok.encode(train_text), dtype=torch.long)
    return Prepared(target, tok, tokens, int(target_cfg.vocab_size), tok.eos_token_id)


def train_register_evaluate(cfg: ExperimentConfig, prep: Prepared, storage: Path,
                            run_name: str, data_dir: Path, tracker,
                            register_as: str | None) -> list[dict]:
    """Stage 2 + registry + engine evaluation into ``tracker``'s run; returns eval rows."""
    from jobs._evaluate import evaluate_pair, tokenized_prompts
    from jobs._train import fit, save_final

    t1 = time.perf_counter()
    result = fit("distill", cfg, storage, run_name, data_dir, prep.vocab, prep.eos,
                 tracker.run_id, tracker.uri if tracker.run_id else None)
    prep.tokenizer.save_pretrained(data_dir / "tokenizer")
    final = save_final(result, cfg, storage / run_name, data_dir / "tokenizer", prep.vocab,
                       prep.eos)
    tracker.log_metrics({"train_s": time.perf_counter() - t1,
                         "final_step": result.metrics["step"],
                         "final_val_loss": result.metrics["val_loss"]})
    uri = tracker.log_model(final, register_as)
    print(f"[distill] drafter saved to {final}" + (f", registered as {uri}" if uri else ""),
          flush=True)
    return evaluate_pair(cfg, prep.target, str(final), tokenized_prompts(cfg, prep.target),
                         tracker, "eval/")


def main(argv: list[str] | None = None) -> int:
    job = start_job(__doc__, argv, prepare)  # bad inputs fail here, before Ray
    cfg, tracker, prep = job.cfg, job.tracker, job.inputs

    from jobs._train import peak_rss_mb
    from speclab.raylib import init_ray
    from speclab.train.distill_data import LOSS_KIND

    storage, run_name = run_dirs(cfg)
    data_dir = storage / run_name / "data"
    kinds = {LOSS_KIND[name] for name in cfg.distill.loss_weights()}
    where = init_ray(job.address, cfg.ray.num_cpus)
    print(f"[distill] running on {where}; run dir {storage / run_name}", flush=True)
    with tracker as t:
        t.set_tags({"job": "distill", "run_dir": str(storage / run_name),
                    "target": prep.target, "loss": ",".join(sorted(cfg.distill.loss_weights()))})
        t0 = time.perf_counter()
        shards, actor_peak = generate(cfg, prep.target, data_dir, kinds, prep.tokens)
        t.log_metrics({"generate_s": time.perf_counter() - t0,
                       "generate_driver_peak_rss_mb": peak_rss_mb(),
                       "generate_actor_peak_rss_mb": actor_peak,
                       **{f"shards.{k}": v for k, v in shards.items()}})
        print(f"[distill] generated {shards} in {time.perf_counter() - t0:.0f}s", flush=True)
        train_register_evaluate(cfg, prep, storage, run_name, data_dir, t,
                                cfg.output.register_as)
    return 0


if __name__ == "__main__":
    sys.exit(main())
