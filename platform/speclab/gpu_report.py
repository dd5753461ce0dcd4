"""``make gpu-report``: the CUDA tests and the benchmark on a GPU, in one command.

    .venv/bin/python -m speclab.gpu_report [--out gpu_report] [--budget-s 600]

On a machine without a CUDA GPU it says so and exits 0. With one it runs, each step in a
subprocess with its share of the time budget (a step that overruns is stopped and
reported as such, the others still run):

1. ``pytest tests/gpu`` (every CUDA test: engine, sampling, readiness, timing, compile,
   Ray Train, Serve, Tune), outcome and duration per test from its JUnit XML;
2. ``speclab bench`` on the GPU in bfloat16 (AR, chain, EAGLE-2 tree, optimal, SALF and
   the Hugging Face baselines; tau, target calls per token, tokens/s, speedup with its
   interval, peak GPU memory) on the reference pair and, with ``--pair``, on
   ``reference-large`` (which comes with an EAGLE drafter: its row is the ``eagle``
   method);
3. ``speclab bench --batch-sizes 1,16`` eager and ``--compile`` (the static cache with
   CUDA graphs).

It writes ``<out>/gpu_report.md`` (the tables) and ``<out>/gpu_report.json`` (every
step's command, exit status, wall time and parsed results). Medusa heads are not part of
the reference pairs, so Medusa has no row here: its CUDA path is covered by the tests
(``tests/gpu/test_cuda_train.py``, ``test_cuda_readiness.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the printed columns of a bench row (those present), in this order
BENCH_COLUMNS = ("method", "tau", "target_calls_per_token", "tokens_per_s", "speedup",
                 "speedup_lo", "speedup_hi", "engine_overhead", "peak_gpu_mb",
                 "identical_to_ar")
BATCH_COLUMNS = ("method", "batch_size", "tau", "tokens_per_s", "speedup", "peak_gpu_mb")


def cuda_device() -> str | None:
    """The GPU's name, or None without CUDA."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def run_step(name: str, cmd: list[str], timeout_s: float, log_dir: Path) -> dict:
    """Run one step in its own process group; its output goes to ``<log_dir>/<name>.log``."""
    log = log_dir / f"{name}.log"
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=os.environ.copy())
        try:
            rc = proc.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=30)
            rc = "timeout"
    return {"step": name, "command": " ".join(cmd), "returncode": rc,
            "wall_s": round(time.perf_counter() - t0, 1), "log": str(log)}


def junit_results(path: Path) -> list[dict]:
    """Per test: name, outcome (passed / failed / skipped / error), seconds."""
    if not path.exists():
        return []
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for kind in ("failure", "error", "skipped"):
            if case.find(kind) is not None:
                outcome = {"failure": "failed"}.get(kind, kind)
        out.append({"test": f"{case.get('classname')}::{case.get('name')}",
                    "outcome": outcome, "seconds": float(case.get("time") or 0.0)})
    return out


def bench_rows(path: Path) -> list[dict]:
    """The rows of a bench JSON (``bench.json`` or ``batch_bench.json``), or []."""
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    return data.get("rows", data if isinstance(data, list) else [])


def markdown(rows: list[dict], columns: tuple[str, ...]) -> str:
    """A markdown table of ``rows`` over the ``columns`` any row has."""
    cols = [c for c in columns if any(c in r for r in rows)]
    if not rows or not cols:
        return "(no rows)\n"

    def cell(v) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the report (see the module docstring); 0 without a GPU, else 0 when every
    step finished with status 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_report")
    ap.add_argument("--budget-s", type=float, default=600.0, help="all steps together")
    ap.add_argument("--pair", action="append", default=None,
                    help="bench pairs (default: reference and reference-large)")
    args = ap.parse_args(argv)
    gpu = cuda_device()
    if gpu is None:
        print("gpu-report: no CUDA GPU on this machine; nothing to run (exit 0)")
        return 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    py, speclab = sys.executable, str(Path(sys.executable).parent / "speclab")
    pairs = args.pair or ["reference", "reference-large"]
    bench = ["--device", "cuda", "--dtype", "bfloat16", "--prompts", "8",
             "--max-new-tokens", "64"]
    steps = [("cuda_tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu",
                             f"--junitxml={out / 'cuda_tests.xml'}"], 0.45)]
    for pair in pairs:
        steps.append((f"bench_{pair}", [speclab, "bench", *bench, "--pair", pair,
                                         "--out", str(out / pair)], 0.15))
    for mode in ("eager", "compiled"):
        steps.append((f"batch_{mode}", [speclab, "bench", *bench, "--batch-sizes", "1,16",
                                        "--out", str(out / f"batch_{mode}"),
                                        *(["--compile"] if mode == "compiled" else [])],
                      0.1))
    results, deadline, saved = [], time.perf_counter() + args.budget_s, 0.0
    for name, cmd, share in steps:  # a step may use its share plus what earlier ones saved
        budget = min(deadline - time.perf_counter(), share * args.budget_s + saved)
        print(f"gpu-report: {name} ({budget:.0f} s budget)", flush=True)
        results.append(run_step(name, cmd, budget, out))
        saved = max(budget - results[-1]["wall_s"], 0.0)
    tests = junit_results(out / "cuda_tests.xml")
    report = {"gpu": gpu, "steps": results, "cuda_tests": tests,
              "bench": {p: bench_rows(out / p / "bench.json") for p in pairs},
              "batch": {m: bench_rows(out / f"batch_{m}" / "batch_bench.json")
                        for m in ("eager", "compiled")}}
    (out / "gpu_report.json").write_text(json.dumps(report, indent=2, default=str))
    counts = {k: sum(t["outcome"] == k for t in tests)
              for k in ("passed", "failed", "error", "skipped")}
    md = [f"# GPU report: {gpu}\n", "## Steps\n",
          markdown(results, ("step", "returncode", "wall_s", "log")),
          f"\n## CUDA tests: {counts}\n", markdown(tests, ("test", "outcome", "seconds"))]
    for pair, rows in report["bench"].items():
        md += [f"\n## Benchmark: {pair} (bfloat16, batch 1)\n", markdown(rows, BENCH_COLUMNS)]
    for mode, rows in report["batch"].items():
        md += [f"\n## Batched engine, {mode}: batch 1 and 16\n", markdown(rows, BATCH_COLUMNS)]
    (out / "gpu_report.md").write_text("".join(md))
    print("".join(md))
    print(f"gpu-report: wrote {out / 'gpu_report.md'} and gpu_report.json")
    return 0 if all(r["returncode"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
