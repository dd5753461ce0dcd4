"""Faults during distillation: a Ray worker node lost while the target's signals are
generated (its shards are generated again, each exactly once and whole), and the
driver of jobs.distill killed during training (``train.resume=true`` continues it from
its checkpoint without generating the finished shards again)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from pathlib import Path

import pytest

from tests.integration.conftest import (
    ROOT,
    _Tree,
    find_run,
    free_port,
    python,
    run_cmd,
    stop_process_tree,
)
from tests.integration.test_train_target import _committed_checkpoint

pytestmark = pytest.mark.integration
DISTILL = "experiments/smoke/distill.yaml"


def _start_node(args: list[str], log: Path, env: dict) -> subprocess.Popen:
    """``ray start ... --block`` in a process group of its own, output to ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen([str(Path(python()).parent / "ray"), "start", *args, "--block"],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _wait_for_log(proc: subprocess.Popen, log: Path, text: str, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if text in log.read_text():
            return
        if proc.poll() is not None:
            pytest.fail(f"ray start exited ({proc.returncode}): {log.read_text()[-3000:]}")
        time.sleep(0.5)
    pytest.fail(f"ray start not ready in {timeout}s: {log.read_text()[-3000:]}")


@pytest.fixture
def head_and_worker(job_env, tmp_path):
    """A head and a worker node on 127.0.0.1 with one CPU each (so one generation actor
    of one CPU lands on each), each ``ray start --block`` in a process group of its own.
    Yields (GCS address, the worker's Popen); at teardown exactly those two groups (and
    what they started) are stopped. The head declares a lost node dead after ~3 missed
    1 s health checks (default: 5 x 3 s)."""
    gcs = free_port()
    # short paths (Ray's socket paths are length-limited), one session folder per node
    temps = [Path("/tmp") / f"fh{os.getpid()}", Path("/tmp") / f"fw{os.getpid()}"]
    head_env = {**job_env, "RAY_health_check_period_ms": "1000",
                "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3"}
    common = ["--num-cpus=1", "--node-ip-address=127.0.0.1", "--object-store-memory=200000000",
              "--memory=2000000000", f"--dashboard-agent-listen-port={free_port()}"]
    head_args = ["--head", f"--port={gcs}", "--include-dashboard=false",
                 f"--ray-client-server-port={free_port()}", f"--temp-dir={temps[0]}",
                 "--disable-usage-stats", *common]
    worker_args = [f"--address=127.0.0.1:{gcs}", f"--temp-dir={temps[1]}", *common[:-1],
                   f"--dashboard-agent-listen-port={free_port()}"]
    nodes: list[subprocess.Popen] = []
    try:
        for name, args, env in (("head", head_args, head_env), ("worker", worker_args, job_env)):
            log = tmp_path / f"ray-{name}.log"
            nodes.append(_start_node(args, log, env))
            _wait_for_log(nodes[-1], log, "Ray runtime started")
        yield f"127.0.0.1:{gcs}", nodes[1]
    finally:
        for proc in reversed(nodes):  # the worker first, then the head
            stop_process_tree(proc, grace=30, leader_grace=60)
        for t in temps:
            shutil.rmtree(t, ignore_errors=True)


def _shards(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(folder.glob("shard-*.parquet"))}


@pytest.mark.slow
def test_worker_node_lost_during_generation(head_and_worker, tiny_pair, tmp_path,
                                            monkeypatch):
    """80 ``kd`` shards on two actors, one per node; once a few shards are written the
    worker node's whole process tree is SIGKILLed. Generation finishes on the head's
    actor: the lost actor's shards are generated again, shards written before the loss
    are not rewritten, every shard exists once with its row count and the examples are
    exactly those of a fault-free run (recomputed here, deterministic given the seed)."""
    import pyarrow.parquet as pq
    import ray
    import torch

    from speclab.api import Decoder
    from speclab.config import DistillJob
    from speclab.pipelines.signals import generate, plan_starts
    from speclab.train import distill_data as dd

    gcs, worker = head_and_worker
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    examples, shard_size = 9600, 120
    cfg = DistillJob.from_dict({"distill": {
        "loss": "word_kd", "examples": examples, "shard_size": shard_size, "seq_len": 16,
        "top_k": 3, "gen_actors": 2, "gen_cpus_per_actor": 1}})
    tokens = torch.arange(3000) % 60
    data = tmp_path / "data"
    stats: dict = {}
    killed: dict = {}

    ray.init(address=gcs, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        deadline = time.time() + 60
        while sum(n["Alive"] for n in ray.nodes()) < 2 and time.time() < deadline:
            time.sleep(0.5)
        assert sum(n["Alive"] for n in ray.nodes()) == 2, ray.nodes()
        head_node = ray.get_runtime_context().get_node_id()  # the driver joins the head

        def kill_worker_node() -> None:
            """SIGKILL the worker node's tree once both actors run and 4 shards exist."""
            end = time.time() + 240
            while time.time() < end:
                if len(stats.get("actors", [])) == 2 and len(_shards(data / "kd")) >= 4:
                    killed["before"] = _shards(data / "kd")
                    killed["actor"] = next(a for a in stats["actors"] if a["node"] != head_node)
                    _Tree(worker).signal(signal.SIGKILL)
                    killed["at"] = time.time()
                    return
                time.sleep(0.05)

        killer = threading.Thread(target=kill_worker_node, daemon=True)
        killer.start()
        t0 = time.time()
        shards, _ = generate(cfg, tiny_pair["target"], data, {"kd"}, tokens, stats=stats)
        elapsed = time.time() - t0
        killer.join(timeout=5)
        end = time.time() + 60  # the cluster, too, has noticed the loss
        while sum(n["Alive"] for n in ray.nodes()) > 1 and time.time() < end:
            time.sleep(0.5)
        alive = sum(n["Alive"] for n in ray.nodes())
    finally:
        ray.shutdown()
    print(f"generation {elapsed:.1f}s; killed with {len(killed.get('before', {}))} shards "
          f"written; stats {json.dumps({k: v for k, v in stats.items() if k != 'actors'})}")
    assert killed, "the worker node was never killed (generation ended first?)"
    assert worker.poll() is not None and alive == 1
    assert {a["node"] for a in stats["actors"][:2]} == {head_node, killed["actor"]["node"]}
    # the lost actor's calls fail with ActorUnavailableError (its connection is gone) or
    # ActorDiedError (once the cluster has declared the node dead)
    assert stats["actors_lost"] == 1, stats
    assert set(stats["errors"]) <= {"ActorUnavailableError", "ActorDiedError"}, stats
    n = examples // shard_size
    assert shards == {"kd": n} and stats["shards_written"] == n
    assert 1 <= len(stats["redispatched"]) <= 2  # what the lost actor held (<= 2 queued)
    assert len(set(stats["redispatched"])) == len(stats["redispatched"])
    after = _shards(data / "kd")
    assert sorted(after) == [f"shard-{i:05d}.parquet" for i in range(n)]
    for name, mtime in killed["before"].items():  # written before the loss: kept as is
        assert after[name] == mtime, name
    assert not list((data / "kd").glob("*.tmp"))

    # every example exactly once, in plan order, and equal to a fault-free computation
    rows = [r for name in sorted(after) for r in pq.read_table(data / "kd" / name).to_pylist()]
    assert [pq.read_metadata(data / "kd" / name).num_rows for name in sorted(after)] == \
        [shard_size] * n
    starts, length = plan_starts(cfg.distill, cfg.train.seed, tokens, "kd")
    windows = [tokens[s : s + length].tolist() for s in starts]
    assert len(rows) == examples and [r["tokens"] for r in rows] == windows
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the actors
    try:
        runner = Decoder.from_pretrained(tiny_pair["target"]).target
        lost = {int(name.split("-")[1].split(".")[0]) for name in stats["redispatched"]}
        for i in sorted(lost | {0, n - 1}):  # the regenerated shards and one at each end
            for j in range(i * shard_size, (i + 1) * shard_size):
                ref = dd.kd_example(runner, windows[j], 3)
                assert rows[j]["topk_ids"] == ref["topk_ids"], (i, j)
                assert torch.allclose(torch.tensor(rows[j]["topk_probs"]),
                                      torch.tensor(ref["topk_probs"]), atol=1e-6), (i, j)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_killed_distill_driver_resumes(job_env, tmp_path):
    """jobs.distill SIGKILLed (driver and its embedded Ray) after Ray Train committed a
    checkpoint; the rerun with ``train.resume=true`` keeps every shard (same mtimes),
    continues training from that checkpoint and finishes; an existing run name without
    ``train.resume=true`` is refused before any work."""
    storage = tmp_path / "runs"
    run_dir = storage / "dk"
    steps = 100
    args = [python(), "-m", "jobs.distill", "--config", DISTILL, f"output.storage_path={storage}",
            "output.run_name=dk", "output.register_as=null", f"train.steps={steps}",
            "train.report_every=20"]
    proc = subprocess.Popen([*args, "tracking.experiment=first"], cwd=ROOT, env=job_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    t0 = time.time()
    tree = _Tree(proc)
    watcher = threading.Thread(target=tree.watch, daemon=True)
    watcher.start()  # learns the embedded Ray's processes while the driver lives
    try:
        deadline = time.time() + 300
        while time.time() < deadline:  # a committed checkpoint, training still running
            if _committed_checkpoint(run_dir):
                break
            if proc.poll() is not None:
                pytest.fail("distill ended before a checkpoint: " + proc.stdout.read()[-3000:])
            time.sleep(0.2)
        else:
            pytest.fail("no checkpoint appeared")
        snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
        os.killpg(proc.pid, signal.SIGKILL)  # the driver's group, at once
        proc.wait(timeout=30)
    finally:
        tree.stop_watching(watcher)
        stop_process_tree(proc, grace=30, tree=tree)  # the orphaned embedded Ray
    t_kill = time.time() - t0
    first_out = proc.stdout.read()
    assert "[distill] drafter saved" not in first_out  # killed during training
    data = run_dir / "data"
    before = {k: _shards(data / k) for k in ("kd", "seq", "tree")}
    assert all(len(v) == 2 for v in before.values()), before

    t1 = time.time()
    refused = run_cmd([*args, "tracking.experiment=refused"], job_env, timeout=180)
    t_refused = time.time() - t1
    assert refused.returncode == 2 and "train.resume=true" in refused.stderr, refused.stderr

    t2 = time.time()
    res = run_cmd([*args, "train.resume=true", "tracking.experiment=resumed"], job_env)
    print(f"killed after {t_kill:.0f}s; refused in {t_refused:.0f}s; resumed run "
          f"{time.time() - t2:.0f}s")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    print(f"committed before the kill: {json.dumps(snapshot)[:300]}")
    assert "0 shards written, 6 kept" in res.stdout, res.stdout[-3000:]
    assert {k: _shards(data / k) for k in before} == before  # not generated again
    client, run = find_run(job_env["MLFLOW_TRACKING_URI"], "resumed")
    m = run.data.metrics
    resumed = [h.value for h in client.get_metric_history(run.info.run_id, "resumed_from_step")]
    assert len(resumed) == 1 and 20 <= resumed[0] < steps and resumed[0] % 20 == 0, resumed
    assert f"[train] resumed from step {int(resumed[0])}" in out
    logged = sorted({h.step for h in client.get_metric_history(run.info.run_id, "loss")})
    assert logged[0] == resumed[0] + 20 and logged[-1] == steps, logged  # only the rest
    assert m["final_step"] == steps and m["generate_shards_kept"] == 6
    assert m["generate_shards_written"] == 0
    assert (run_dir / "model" / "config.json").exists()
    print(f"resumed from step {int(resumed[0])}; loss steps {logged[0]}..{logged[-1]}")


def _write_shard(path: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"tokens": [i]} for i in range(rows)]), path)


def test_check_shards_requires_every_example_exactly_once(tmp_path):
    """Shards 0..n-1 with their row counts pass; a truncated, missing or extra shard (a
    reader would see an example twice or never) fails naming it."""
    from speclab.config import DistillJob
    from speclab.pipelines.signals import check_shards

    d = DistillJob.from_dict({"distill": {"loss": "word_kd", "examples": 10,
                                          "shard_size": 4}}).distill
    kd = tmp_path / "kd"
    kd.mkdir()
    for i, rows in enumerate([4, 4, 2]):
        _write_shard(kd / f"shard-{i:05d}.parquet", rows)
    assert check_shards(tmp_path, {"kd"}, d) == {"kd": 10}
    _write_shard(kd / "shard-00001.parquet", 3)
    with pytest.raises(ValueError, match=r"9 examples, want 10; shard-00001.parquet: 3 rows"):
        check_shards(tmp_path, {"kd"}, d)
    _write_shard(kd / "shard-00001.parquet", 4)
    _write_shard(kd / "shard-00003.parquet", 2)
    with pytest.raises(ValueError, match=r"\[\] missing and \['shard-00003.parquet'\] unexp"):
        check_shards(tmp_path, {"kd"}, d)
    (kd / "shard-00003.parquet").unlink()
    (kd / "shard-00002.parquet").unlink()
    with pytest.raises(ValueError, match=r"\['shard-00002.parquet'\] missing"):
        check_shards(tmp_path, {"kd"}, d)


def test_generation_refuses_shards_of_another_plan(tiny_pair, tmp_path):
    """Shards made with another seed / size are never mixed with new ones (no Ray)."""
    import torch

    from speclab.config import DistillJob
    from speclab.pipelines.signals import _check_plan, generate

    cfg = DistillJob.from_dict({"distill": {"loss": "word_kd", "examples": 8,
                                            "shard_size": 4, "seq_len": 8}})
    (tmp_path / "kd").mkdir()
    _check_plan(tmp_path / "kd", {"kind": "kd", "examples": 8, "seed": -1})
    with pytest.raises(ValueError, match="generated with another plan"):
        generate(cfg, tiny_pair["target"], tmp_path, {"kd"}, torch.arange(200) % 60)


def test_shard_given_up_after_bounded_attempts(tmp_path):
    """An actor that dies on every shard: the shard is dispatched 3 times, each to a
    replacement actor, then generation fails naming it."""
    import ray

    from speclab.pipelines.signals import MAX_SHARD_ATTEMPTS, _Actors, _run, _Shard
    from speclab.raylib import quiet_ray_env

    @ray.remote(num_cpus=0.5, max_restarts=0)
    class Crasher:
        def ready(self) -> dict:
            return {"pid": os.getpid(), "node": "local"}

        def shard(self, kind, inputs, path, first, masks=None) -> float:
            os._exit(1)  # the worker process dies mid-shard

    quiet_ray_env()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    stats = {"actors": [], "actors_lost": 0, "redispatched": [], "errors": [],
             "shards_written": 0}
    actors = _Actors(lambda: Crasher.remote(), limit=MAX_SHARD_ATTEMPTS)
    todo = deque([_Shard("kd", 7, tmp_path / "shard-00007.parquet", 28, 4)])
    try:
        with pytest.raises(RuntimeError, match=r"shard kd/shard-00007.parquet .* failed 3 "
                                               r"times; last error: ActorDiedError"):
            _run(actors, todo, lambda s: ([[1, 2]] * s.rows, None), 1, stats)
    finally:
        actors.kill_all()
        ray.shutdown()
    assert stats["actors_lost"] == 3 and len(stats["actors"]) == 3
    assert stats["redispatched"] == ["kd/shard-00007.parquet"] * 2
    assert not (tmp_path / "shard-00007.parquet").exists()
