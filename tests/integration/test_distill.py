"""jobs.distill end to end, chained after jobs.train_target through the MLflow registry;
generation resume; bad input before any work."""

from __future__ import annotations

import pytest

from tests.integration.conftest import (
    find_run,
    method_children,
    python,
    refused_before_work,
    run_cmd,
)

pytestmark = pytest.mark.integration
DISTILL = "experiments/smoke/distill.yaml"


def test_target_then_drafter_both_registered_and_loadable(job_env, tmp_path, monkeypatch):
    runs = f"output.storage_path={tmp_path / 'runs'}"
    t = run_cmd([python(), "-m", "jobs.train_target", "--config",
                 "experiments/smoke/train_target.yaml", runs, "tracking.experiment=t"], job_env)
    assert t.returncode == 0, t.stderr[-3000:]
    d = run_cmd([python(), "-m", "jobs.distill", "--config", DISTILL, runs,
                 "models.target=models:/speclab-smoke-target/1", "tracking.experiment=d"],
                job_env)
    assert d.returncode == 0, d.stderr[-3000:]
    assert "registered as models:/speclab-smoke-drafter/1" in d.stdout
    client, run = find_run(job_env["MLFLOW_TRACKING_URI"], "d")
    m = run.data.metrics
    assert m["final_step"] == 20 and m["shards.kd"] == 2 and m["shards.tree"] == 2
    assert m["generate_shards_written"] == 6 and m["generate_shards_kept"] == 0
    assert m["generate_actors_lost"] == 0 and m["generate_shards_redispatched"] == 0
    assert m["generate_actor_peak_rss_mb"] > 0 and m["peak_rss_mb"] > 0
    assert m["eval/best_tau"] >= 1.0
    evals = method_children(client, run)  # the drafter's evaluation: a run per method
    assert any(k.startswith("salf(") for k in evals) and "ar" in evals, sorted(evals)
    assert [h.step for h in client.get_metric_history(run.info.run_id, "loss")] == [10, 20]
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"eval_results.csv", "eval_tau_per_method.png", "config.yaml"} <= arts, arts
    version = client.get_model_version("speclab-smoke-drafter", "1")
    assert version.run_id == run.info.run_id  # registered from this very run

    from speclab.api import Decoder

    monkeypatch.setenv("MLFLOW_TRACKING_URI", job_env["MLFLOW_TRACKING_URI"])
    dec = Decoder.from_pretrained("models:/speclab-smoke-target/1",
                                  "models:/speclab-smoke-drafter/1")
    ar = dec.generate("def f(x):", method="ar", max_new_tokens=10)
    sd = dec.generate("def f(x):", method="salf", max_new_tokens=10, salf_threshold=0.3)
    assert sd.token_ids == ar.token_ids  # lossless with the distilled drafter


def test_generation_keeps_finished_shards(tiny_pair, tmp_path, capsys):
    """A rerun regenerates only missing shards (resume without redoing finished work) and
    removes what a writer killed mid-write left behind; each written shard prints a
    progress line (shards of this run, examples, rate, ETA)."""
    import ray
    import torch

    from speclab.config import DistillJob
    from speclab.pipelines.signals import generate
    from speclab.raylib import quiet_ray_env

    quiet_ray_env()
    cfg = DistillJob.from_dict({"distill": {"loss": "word_kd", "examples": 12,
                                                  "shard_size": 4, "seq_len": 8, "top_k": 3,
                                                  "gen_actors": 1}})
    tokens = torch.arange(200) % 60
    data = tmp_path / "data"
    ray.init(address="local", num_cpus=2, include_dashboard=False)  # never a running cluster
    try:
        shards, peak = generate(cfg, tiny_pair["target"], data, {"kd"}, tokens)
        assert shards == {"kd": 3} and peak > 0
        out = capsys.readouterr().out
        assert "[generate] 1/3 shards (4 examples) in " in out
        assert "[generate] 3/3 shards (12 examples) in " in out and "ETA 0 s" in out
        shards = sorted((data / "kd").glob("shard-*.parquet"))
        assert len(shards) == 3
        before = {p.name: p.stat().st_mtime_ns for p in shards}
        shards[1].unlink()
        (data / "kd" / "shard-00001.parquet.0123abcd.tmp").write_bytes(b"PAR1 cut short")
        stats: dict = {}
        generate(cfg, tiny_pair["target"], data, {"kd"}, tokens, stats=stats)
        after = {p.name: p.stat().st_mtime_ns for p in (data / "kd").glob("shard-*.parquet")}
    finally:
        ray.shutdown()
    assert set(after) == set(before)
    assert stats["shards_kept"] == 2 and stats["shards_written"] == 1
    assert "[generate] 1/1 shards (4 examples) in " in capsys.readouterr().out  # this run's
    assert after[shards[0].name] == before[shards[0].name]  # untouched
    assert after[shards[2].name] == before[shards[2].name]
    assert not list((data / "kd").glob("*.tmp"))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["distill.loss=nope"], "unknown loss ['nope']"),
        (["distill.loss={sft: 0}"], "at least one positive weight"),
        (["corpus.source=text_folder", "corpus.path=/nonexistent/c"], "corpus.path"),
        (["tokenizer.path={tok}"], "does not match the target's tokenizer"),
        (["models.target=/nonexistent/model"], "models.target: model directory"),
    ],
)
def test_bad_input_fails_before_work(job_env, tmp_path, overrides, message):
    from speclab.models.tokenizer import train_bpe_tokenizer

    if any("{tok}" in o for o in overrides):
        train_bpe_tokenizer(["def f(x):\n    return x\n" * 50], 320, tmp_path / "tok")
    overrides = [o.replace("{tok}", str(tmp_path / "tok")) for o in overrides]
    refused_before_work("distill", DISTILL, overrides, message, job_env, tmp_path / "runs")
