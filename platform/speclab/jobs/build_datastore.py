"""Build a REST retrieval datastore (suffix arrays) from a corpus with Ray tasks.

    python -m jobs.build_datastore --config experiments/smoke/build_datastore.yaml

Driver: resolves the target (its tokenizer defines the token ids), loads the ``corpus``
training text and cuts it into ``datastore.shards`` pieces at line boundaries. One Ray
task per shard tokenises its piece and builds its suffix array
(:mod:`speclab.decoding.datastore`), writing ``shard-XXXXX.npz`` into
``datastore.output``; the driver writes ``datastore.json`` and logs the token count,
build time and the manifest to MLflow. Use it with ``--method rest --datastore DIR``.
"""

from __future__ import annotations

import time
from pathlib import Path

from speclab.config import BuildDatastoreJob
from speclab.data.text import load_corpus
from speclab.decoding.datastore import build_shard, write_manifest
from speclab.models.loading import load_tokenizer, resolve_source
from speclab.models.registry import resolve_models
from speclab.paths import speclab_home
from speclab.pipelines.cli import start_job
from speclab.raylib import init_ray


def prepare(cfg: BuildDatastoreJob) -> tuple[str, list[str], Path]:
    """(target folder, corpus pieces, output folder); ValueError on bad input."""
    target, _ = resolve_models(cfg.models.target, None)
    target = resolve_source(target, "models.target")
    load_tokenizer(target, field="models.target")  # fails early without a tokenizer
    text, _ = load_corpus(cfg.corpus.source, cfg.corpus.path, cfg.corpus.max_chars,
                          cfg.corpus.val_chars, cfg.corpus.text_field)
    n = cfg.datastore.shards
    cuts = [0] + [text.find("\n", len(text) * i // n) + 1 for i in range(1, n)] + [len(text)]
    pieces = [text[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]
    out = Path(cfg.datastore.output or speclab_home() / "datastores" / cfg.name).expanduser()
    return target, pieces, out


def build(target: str, pieces: list[str], out: Path, max_len: int) -> tuple[int, list[str]]:
    """Shards on Ray tasks; returns (tokens, shard file names)."""
    import ray

    @ray.remote(num_cpus=1)
    def shard(text: str, path: str) -> int:
        import numpy as np

        tok = load_tokenizer(target, field="models.target")
        docs = [tok.encode(d, add_special_tokens=False) for d in text.split("\n\n") if d]
        toks, sa = build_shard(docs, max_len)
        tmp = path + ".tmp.npz"
        np.savez(tmp, tokens=toks, sa=sa)
        Path(tmp).replace(path)  # a shard is whole or absent
        return int(sum(len(d) for d in docs))

    out.mkdir(parents=True, exist_ok=True)
    names = [f"shard-{i:05d}.npz" for i in range(len(pieces))]
    counts = ray.get([shard.remote(p, str(out / n)) for p, n in zip(pieces, names)])
    write_manifest(out, names, max_len, sum(counts))
    return sum(counts), names


def main(argv: list[str] | None = None) -> int:
    job = start_job("build_datastore", __doc__, argv, prepare)
    cfg, tracker, (target, pieces, out) = job.cfg, job.tracker, job.inputs

    where = init_ray(job.address, cfg.ray.num_cpus)
    print(f"[build_datastore] running on {where}; {len(pieces)} shards -> {out}", flush=True)
    with tracker as t:
        t.set_tags({"job": "build_datastore", "datastore": str(out), "target": target})
        t0 = time.perf_counter()
        tokens, names = build(target, pieces, out, cfg.datastore.max_len)
        secs = time.perf_counter() - t0
        t.log_metrics({"tokens": tokens, "shards": len(names), "build_s": secs})
        t.log_text((out / "datastore.json").read_text(), "datastore.json")
    print(f"[build_datastore] {tokens} tokens in {len(names)} shards, {secs:.1f}s: {out}",
          flush=True)
    return 0
