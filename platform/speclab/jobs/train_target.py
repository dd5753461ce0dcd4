"""Train a LLaMA-architecture target on a corpus with Ray Train (DDP), register it in MLflow.

    python -m jobs.train_target --config experiments/smoke/train_target.yaml [key=value ...]

Driver: validates the config, checks the tracking server, trains (or loads) the
tokenizer and tokenises the corpus into ``<storage>/<run>/data`` (so bad data fails
before any worker starts), then runs a ``TorchTrainer`` (``scaling.num_workers``
workers; gloo on CPU, NCCL on GPU) with checkpoints under ``<storage>/<run>`` and
``FailureConfig(max_failures)``: a dead worker restarts the group from the latest
checkpoint. Rank 0 logs loss, validation loss/perplexity, tokens/s per worker and peak
memory per report to the MLflow run the driver opened. At the end the model and
tokenizer are saved with ``save_pretrained`` and registered (``output.register_as``).
``train.resume=true output.run_name=X`` continues run X from its latest checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from speclab.config import TrainTargetJob
from speclab.data.text import load_corpus
from speclab.models.tokenizer import train_bpe_tokenizer
from speclab.pipelines.cli import run_dirs, start_job
from speclab.pipelines.fit import fit, save_final
from speclab.raylib import init_ray
from speclab.train.tasks import LMTaskConfig


def prepare_data(cfg: TrainTargetJob, run_dir: Path) -> tuple[Path, int, int]:
    """Tokenizer + token tensors in ``run_dir/data``; returns (dir, vocab, eos id)."""
    import torch
    from transformers import AutoTokenizer

    data = run_dir / "data"
    if (data / "train.pt").exists():  # resumed run: reuse what the first attempt wrote
        tok = AutoTokenizer.from_pretrained(data / "tokenizer", trust_remote_code=False)
        return data, len(tok), tok.eos_token_id
    train_text, val_text = load_corpus(cfg.corpus.source, cfg.corpus.path, cfg.corpus.max_chars,
                                       cfg.corpus.val_chars, cfg.corpus.text_field)
    if cfg.tokenizer.path:
        if not Path(cfg.tokenizer.path).exists():
            raise ValueError(f"tokenizer.path: {cfg.tokenizer.path!r} does not exist")
        tok = AutoTokenizer.from_pretrained(cfg.tokenizer.path, trust_remote_code=False)
        tok.save_pretrained(data / "tokenizer")
    else:
        tok = train_bpe_tokenizer([train_text[: cfg.tokenizer.train_chars]],
                                  cfg.tokenizer.vocab_size, data / "tokenizer")
    train_ids = torch.tensor(tok.encode(train_text), dtype=torch.long)
    val_ids = torch.tensor(tok.encode(val_text), dtype=torch.long)
    need = cfg.train.seq_len + 2
    if train_ids.numel() < need or val_ids.numel() < need:
        raise ValueError(f"corpus: too little text for train.seq_len={cfg.train.seq_len} "
                         f"({train_ids.numel()} train / {val_ids.numel()} validation tokens)")
    torch.save(train_ids, data / "train.pt")
    torch.save(val_ids, data / "val.pt")
    return data, len(tok), tok.eos_token_id


def prepare(cfg: TrainTargetJob) -> tuple[Path, str, Path, int, int]:
    """(storage, run name, data dir, vocab, eos id); refuses to overwrite a named run."""
    storage, run_name = run_dirs(cfg)
    if (storage / run_name).exists() and not cfg.train.resume and cfg.output.run_name:
        raise ValueError(f"output.run_name: {run_name!r} exists in {storage}; set "
                         "train.resume=true to continue it or choose another name")
    return storage, run_name, *prepare_data(cfg, storage / run_name)


def main(argv: list[str] | None = None) -> int:
    job = start_job("train_target", __doc__, argv, prepare)
    cfg, tracker = job.cfg, job.tracker
    storage, run_name, data_dir, vocab, eos = job.inputs
    run_dir = storage / run_name

    where = init_ray(job.address, cfg.ray.num_cpus)
    print(f"[train_target] running on {where}; run dir {run_dir}", flush=True)
    with tracker as t:
        t.set_tags({"job": "train_target", "run_dir": str(run_dir)})
        task = LMTaskConfig(train=cfg.train, arch=cfg.arch)
        result = fit(task, cfg.scaling, storage, run_name, data_dir, vocab, eos,
                     tracker.run_id, tracker.uri if tracker.run_id else None)
        final = save_final(result, cfg.arch, run_dir, data_dir / "tokenizer", vocab, eos)
        t.log_metrics({"final_step": result.metrics["step"],
                       "final_val_loss": result.metrics["val_loss"]})
        uri = t.log_model(final, cfg.output.register_as)
    print(f"[train_target] model saved to {final}", flush=True)
    if uri:
        print(f"[train_target] registered as {uri}", flush=True)
    return 0
