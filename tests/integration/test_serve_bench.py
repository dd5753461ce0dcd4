"""``serve_apps.bench`` as a user runs it: plain decoding's app and a method's app up
together on 127.0.0.1, timed in pairs, the speedup through Serve written with its
interval, every served output checked against the in-process engine's, and every
process the bench started stopped (tiny pair, colocated, two passes of one client and of
an open-loop load)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from speclab.paths import repo_root
from speclab.proctree import proc_table
from tests.integration.test_serve import tiny  # noqa: F401

pytestmark = pytest.mark.integration


def _descendants(pid: int) -> set[int]:
    table = proc_table()
    out, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        kids = {p for p, (ppid, *_rest) in table.items() if ppid == parent}
        out |= kids
        todo += list(kids)
    return out


def test_the_serve_bench_pairs_a_method_with_plain_decoding(tmp_path, tiny):  # noqa: F811
    target, draft = tiny
    out = tmp_path / "serve_bench.json"
    env = {"SPECLAB_HOME": str(tmp_path / "home"), "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0", "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve_apps.bench", "--config", "experiments/smoke/serve.yaml",
         "--methods", "ar,chain", "--clients", "1", "--requests", "3", "--passes", "2",
         "--rates", "40", "--rate-requests", "4", "--max-tokens", "12", "--out", str(out),
         f"models.target={target}", f"models.draft={draft}", "serve.topology=colocated"],
        cwd=repo_root(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: set[int] = set()
    try:
        stdout, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            seen = _descendants(proc.pid)
            proc.kill()
    assert proc.returncode == 0, stdout[-3000:]
    assert not seen
    report = json.loads(out.read_text())
    assert report["paired_with_ar"] is True and report["passes"] == 2
    chain = report["methods"]["chain"]["serve"]["1"]
    # one client: a pair per request and pass
    assert chain["speedup_pairs"] == 6 and chain["requests"] == 6 and chain["errors"] == 0
    assert chain["speedup_lo"] <= chain["speedup"] <= chain["speedup_hi"]
    assert chain["identical_to_in_process"] is True and chain["tau"] > 1.0
    # rounds per draft budget, from the responses' SD statistics: one entry per round
    assert sum(chain["round_budgets"].values()) == round(
        chain["target_calls_per_token"] * chain["tokens"])
    assert max(int(k) for k in chain["round_budgets"]) >= 1
    assert chain["replica_budgets"] == [None]  # a fixed budget: no auto budget learned
    # the open-loop load: 4 requests a pass at 40/s, a pair per pass (summed latencies)
    opened = report["methods"]["chain"]["serve"]["40/s"]
    assert opened["rate"] == 40.0 and opened["clients"] == 0
    assert opened["speedup_pairs"] == 2 and opened["requests"] == 8
    assert opened["errors"] == 0 and opened["identical_to_in_process"] is True
    assert opened["speedup_lo"] <= opened["speedup"] <= opened["speedup_hi"]
    assert report["methods"]["ar"]["serve"]["40/s"]["chain"]["requests"] == 8
    assert any(x.startswith("chain ") and " 40/s " in x for x in stdout.splitlines())
    ar = report["methods"]["ar"]["serve"]["1"]["chain"]  # the AR runs paired with chain
    assert ar["requests"] == 6 and ar["identical_to_in_process"] is True
    assert ar["tau"] == 1.0
    assert "in_process" in report["methods"]["ar"]
    line = next(x for x in stdout.splitlines() if x.startswith("chain ") and "x [" in x)
    assert f"{chain['speedup']:.2f}x [{chain['speedup_lo']:.2f}, " in line
    # both apps' logs, and nothing the bench started outlives it
    assert (tmp_path / "serve_ar.log").exists() and (tmp_path / "serve_chain.log").exists()
    left = [p for p, (_pp, pgid, *_r) in proc_table().items() if pgid == proc.pid]
    assert not left
