"""Stage: the target's distillation signals, generated on Ray actors (distill,
compare_losses, train_head, specdecpp_eval, tune).

The corpus (tokenised with the target's tokenizer) is cut into deterministic windows;
target replicas on Ray actors turn them into what the losses need (``kd``, ``seq``,
``tree`` examples; ``feat`` windows with the target's features for EAGLE drafters, and
``feat_tree`` ones that add a target-built tree at every position for TALF on them;
``medusa`` prompts continued by the target, with its features, for Medusa heads;
``accept`` data for SpecDec++ heads; see :mod:`speclab.train.distill_data`) and write Parquet shards
``<data>/<kind>/shard-NNNNN.parquet`` one at a time (written to a temporary name, then
renamed, so a shard is either whole or absent). Shards already present are not
regenerated, so a rerun resumes generation too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speclab.config.schema import DistillConfig


def plan_starts(d: DistillConfig, seed: int, tokens, kind: str) -> tuple[list[int], int]:
    """Deterministic corpus offsets and length of ``kind``'s inputs (windows / prompts /
    contexts); the inputs themselves are sliced per shard, so memory stays bounded."""
    import torch

    length = {"kd": d.seq_len + 1, "feat": d.seq_len + 1, "feat_tree": d.seq_len + 1,
              "seq": d.prompt_len, "medusa": d.prompt_len,
              "tree": d.context_len, "accept": d.prompt_len}[kind]
    if tokens.numel() <= length + 1:
        raise ValueError(f"corpus: too little text for {kind} examples of {length} tokens")
    g = torch.Generator().manual_seed(seed + 7919 * len(kind))
    starts = torch.randint(0, tokens.numel() - length - 1, (d.examples,), generator=g)
    return starts.tolist(), length


def generate(cfg: Any, target: str, data_dir: Path, kinds: set[str], tokens,
             draft: str | None = None, head_temperature: float = 0.0
             ) -> tuple[dict[str, int], float]:
    """The target's signals on an actor pool; returns (shards per kind, the actors' peak
    RSS in MB). ``cfg``: a job config with ``distill``, ``models`` and ``train`` groups
    (generation settings, dtype/device, seed).

    The ``accept`` kind (SpecDec++ head data) also needs the local ``draft`` folder and
    the temperature the head is trained for."""
    if "accept" in kinds and draft is None:
        raise ValueError("models.draft: acceptance-head data needs a drafter")
    import ray

    d, seed = cfg.distill, cfg.train.seed
    if "feat_tree" in kinds:
        talf_k, talf_depth = cfg.eagle.talf_top_k, cfg.eagle.talf_depth
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
            elif kind == "feat":
                rows = [dd.feat_example(runner, x, d.top_k) for x in inputs]
            elif kind == "feat_tree":
                rows = [dd.feat_forest_example(runner, x, d.top_k, talf_k, talf_depth)
                        for x in inputs]
            elif kind == "medusa":
                rows = dd.medusa_examples(runner, inputs, d.response_len, d.top_k)
            elif kind == "seq":
                rows = dd.seq_examples(runner, inputs, d.response_len, eos)
            elif kind == "accept":
                rows = [dd.accept_example(runner, self.dec.draft, x, d.response_len,
                                          head_temperature, seed + first + j,
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
            starts, length = plan_starts(d, seed, tokens, kind)
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


def generate_logged(cfg: Any, prep: Prepared, data_dir: Path, tracker, kinds: set[str],
                    job: str) -> dict[str, int]:
    """:func:`generate` of ``kinds`` for ``prep.target``, with its wall time, the peak
    memory of the driver and the actors and the shard counts logged to ``tracker``."""
    import time

    from speclab.pipelines.fit import peak_rss_mb

    t0 = time.perf_counter()
    shards, actor_peak = generate(cfg, prep.target, data_dir, kinds, prep.tokens)
    tracker.log_metrics({"generate_s": time.perf_counter() - t0,
                         "generate_driver_peak_rss_mb": peak_rss_mb(),
                         "generate_actor_peak_rss_mb": actor_peak,
                         **{f"shards.{k}": v for k, v in shards.items()}})
    print(f"[{job}] generated {shards} in {time.perf_counter() - t0:.0f}s", flush=True)
    return shards


@dataclass
class Prepared:
    """Inputs checked and loaded on the driver before any Ray work."""

    target: str
    tokenizer: object
    tokens: object  # 1-D LongTensor of the tokenised training corpus
    vocab: int
    eos: int | None


def prepare_target(cfg: Any) -> Prepared:
    """Resolve the target, check tokenizer/vocabulary, load the corpus (ValueError if bad).
    ``cfg``: a job config with ``models``, ``tokenizer`` and ``corpus`` groups."""
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
