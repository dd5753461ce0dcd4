"""``make gpu-report``: the CUDA tests and the benchmark on a GPU, in one command.

    .venv/bin/python -m speclab.gpu_report [--out gpu_report] [--budget-s 600]

On a machine without a CUDA GPU it says so and exits 0. With one it runs, each step in a
subprocess with its share of the time budget (a step that overruns is stopped and
reported as such, the others still run):

1. ``pytest tests/gpu`` (every CUDA test: engine, sampling, readiness, timing, compile,
   Ray Train, Serve, Tune), outcome, duration and error per test from the JSON-lines log
   the tests' conftest writes as they run (so a session stopped at its budget, or one
   that hangs at exit after its last test, still reports every test that ran);
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
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from speclab.proctree import ProcessTree, stop_process_tree

ROOT = Path(__file__).resolve().parents[2]
#: the printed columns of a bench row (those present), in this order
BENCH_COLUMNS = ("method", "tau", "target_calls_per_token", "tokens_per_s", "speedup",
                 "speedup_lo", "speedup_hi", "engine_overhead", "engine_clocked", "peak_gpu_mb",
                 "identical_to_ar", "near_ties", "differing")
BATCH_COLUMNS = ("method", "batch_size", "tau", "tokens_per_s", "speedup", "peak_gpu_mb",
                 "identical_to_alone", "near_ties", "differing")


def cuda_device() -> str | None:
    """The GPU's name, or None without CUDA."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def run_step(name: str, cmd: list[str], timeout_s: float, log_dir: Path,
             env: dict | None = None, finished=None, exit_grace_s: float = 30.0) -> dict:
    """Run one step in its own process group; its output goes to ``<log_dir>/<name>.log``.
    ``finished()`` (optional, polled each second) says the step's work is done: a process
    still running ``exit_grace_s`` later is stopped and reported as ``hung at exit``.
    Whatever the step started is gone when this returns (:func:`stop_step`), so the next
    step is timed on an idle machine."""
    log = log_dir / f"{name}.log"
    t0 = time.perf_counter()
    deadline, done_at, rc = t0 + max(timeout_s, 1.0), None, None
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, **(env or {})},
                                preexec_fn=_default_sigint)
        tree = ProcessTree(proc)
        watcher = threading.Thread(target=tree.watch, daemon=True)
        watcher.start()  # knows the jobs' Ray workers even once their parents are gone
        while rc is None:
            try:
                rc = proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                now = time.perf_counter()
                if done_at is None and finished is not None and finished():
                    done_at = now
                if now > deadline or (done_at is not None and now > done_at + exit_grace_s):
                    rc = "timeout" if done_at is None else "hung at exit"
        tree.stop_watching(watcher)
        left = stop_step(proc, tree)
    return {"step": name, "command": " ".join(cmd), "returncode": rc,
            "wall_s": round(time.perf_counter() - t0, 1), "log": str(log),
            **({"survivors": left} if left else {})}


def _default_sigint() -> None:
    """In a step's process before it starts: SIGINT back to its default action. A shell
    starts background commands with SIGINT ignored, children inherit that, and Python
    then never installs its KeyboardInterrupt handler: :func:`stop_step`'s SIGINT would
    be lost and every stop would wait out its grace."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop_step(proc: subprocess.Popen, tree: ProcessTree, grace_s: float = 20.0) -> str:
    """Stop a step and everything it started, in or out of its process group (a test's
    job in a session of its own, Ray's workers). SIGINT to the leader first (pytest then
    still logs and runs its tests' own clean-up, which stops their jobs), then SIGTERM and
    SIGKILL to the whole tree. Returns what survived, as text ('' when nothing did): a
    first GPU run lost its benchmark to two killed tests' training jobs still running."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        stop_process_tree(proc, grace=10, tree=tree)
    except AssertionError as err:
        return str(err)
    return ""


def read_test_log(path: Path) -> tuple[int | None, list[dict]]:
    """The JSON-lines test log ``tests/gpu/conftest.py`` writes: (tests collected or None,
    one record per test: test, phase, outcome, seconds, error)."""
    if not path.exists():
        return None, []
    collected, tests = None, []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "collected" in rec:
            collected = rec["collected"]
        else:
            tests.append(rec)
    return collected, tests


def bench_rows(path: Path) -> list[dict]:
    """The rows of a bench JSON (``bench.json`` or ``batch_bench.json``), or []."""
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    return data.get("rows", data if isinstance(data, list) else [])


def all_reported(path: Path) -> bool:
    """Whether every collected test has its outcome in the test log."""
    collected, tests = read_test_log(path)
    return collected is not None and len({t["test"] for t in tests}) >= collected


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


#: the CUDA tests' pytest temporary folder, one per report process: pytest's default
#: (``/tmp/pytest-of-<user>``) would have the session, at its end, prune the numbered
#: folders of every other pytest session on the machine (a CI run's 50 s clean-up, under
#: the running suite's own sessions, was stopped as "hung at exit")
PYTEST_BASETEMP = Path(tempfile.gettempdir()) / f"speclab-cuda-tests-{os.getpid()}"


def pytest_command(py: str) -> list[str]:
    """The CUDA tests' pytest command: no cache, failures listed, its own temporary
    folder (:data:`PYTEST_BASETEMP`, removed when the report ends)."""
    return [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
            "--basetemp", str(PYTEST_BASETEMP)]


def full_steps(args: argparse.Namespace, out: Path) -> tuple[list, dict, dict]:
    """``make gpu-report``'s steps ``[(name, command, share of the budget)]`` and where
    their bench JSONs go (``{pair: folder}``, ``{mode: folder}``): every CUDA test, the
    bench on each pair, the batched engine eager and compiled at batch 1 and 16."""
    py = sys.executable
    speclab = [py, "-m", "speclab.cli"]  # also where speclab is on PYTHONPATH, not installed
    pairs = args.pair or ["reference", "reference-large"]
    bench = ["--device", "cuda", "--dtype", "bfloat16", "--max-new-tokens",
             str(args.max_new_tokens)]
    steps = [("cuda_tests", [*pytest_command(py), "tests/gpu", *shlex.split(args.test_args)], 0.55)]
    for pair in pairs:
        steps.append((f"bench_{pair}", [*speclab, "bench", *bench, "--pair", pair,
                                         "--prompts", str(args.prompts),
                                         "--out", str(out / pair)], 0.1))
    for mode in ("eager", "compiled"):
        steps.append((f"batch_{mode}", [*speclab, "bench", *bench, "--prompts", "16",
                                        "--batch-sizes", "1,16",
                                        "--out", str(out / f"batch_{mode}"),
                                        *(["--compile"] if mode == "compiled" else [])],
                      0.125))
    return (steps, {p: out / p for p in pairs},
            {m: out / f"batch_{m}" for m in ("eager", "compiled")})


def offline_steps(args: argparse.Namespace, out: Path) -> tuple[list, dict, dict]:
    """The Ray-free report's steps (``--offline``, what ``speclab gpu-bundle``'s script
    runs): the Ray-free CUDA tests (4 pytest-xdist workers where it is installed: the
    tests' tiny models are bound by the host, not the GPU), ``speclab bench`` on
    ``reference-xl`` (``--xl``, ``--xl-checksums``, the small drafters ``--eagle``): first
    the batched engine compiled at batch 1 on 2 prompts (the standalone draft's chains
    and SALF, the EAGLE drafters' tree: each EAGLE drafter on a fast path of its own),
    then ``speclab bench`` eager on at most 4 prompts. The shares (0.3 / 0.35 / 0.35; a
    step may also use what earlier ones left) are sized from the H200 runs of the 24x16
    target: the tests took 127 s on 4 workers, the eager bench 192 s on 4 prompts plus
    the Hugging Face rows, the compile warm-up 92 s without EAGLE. ``--rehearse``: on the
    CPU in float32, 2 prompts x 16 tokens, the batched engine eager (compiling on a CPU
    takes minutes)."""
    import importlib.util

    from speclab.gpu_bundle import RAY_FREE_TESTS, RAY_TESTS_THERE

    py = sys.executable
    device, dtype = ("cpu", "float32") if args.rehearse else ("cuda", "bfloat16")
    prompts, tokens = ((min(args.prompts, 2), min(args.max_new_tokens, 16)) if args.rehearse
                       else (min(args.prompts, 4), args.max_new_tokens))
    xl = ["--pair", "reference-xl", "--xl", args.xl, "--device", device, "--dtype", dtype,
          "--max-new-tokens", str(tokens),
          *(["--xl-checksums", args.xl_checksums] if args.xl_checksums else [])]
    eagles = [x for e in args.eagle for x in ("--eagle", e)]
    workers = (["-n", "4", "--dist", "loadfile"]
               if importlib.util.find_spec("xdist") and not args.rehearse else [])
    steps = [("cuda_tests", [*pytest_command(py), *workers, *RAY_FREE_TESTS,
                             *[x for t in RAY_TESTS_THERE for x in ("--deselect", t)],
                             *shlex.split(args.test_args)], 0.3),
             ("batch_compiled", [py, "-m", "speclab.cli", "bench", *xl, *eagles, "--prompts",
                                 str(min(prompts, 2)), "--batch-sizes", "1",
                                 *([] if args.rehearse else ["--compile"]),
                                 "--out", str(out / "batch_compiled")], 0.35),
             ("bench_reference-xl", [py, "-m", "speclab.cli", "bench", *xl, *eagles,
                                     "--prompts", str(prompts),
                                     "--out", str(out / "reference-xl")], 0.35)]
    return steps, {"reference-xl": out / "reference-xl"}, {"compiled": out / "batch_compiled"}


def xl_meta(dirs: list[Path]) -> dict | None:
    """``reference-xl``'s build record (sizes, checksums, function check, forward cost)
    from the first bench JSON under ``dirs`` that has one."""
    for d in dirs:
        for name in ("bench.json", "batch_bench.json"):
            f = d / name
            if f.exists():
                meta = json.loads(f.read_text()).get("meta", {})
                if "reference_xl" in meta:
                    return meta["reference_xl"]
    return None


def xl_section(meta: dict) -> str:
    """Markdown of :func:`xl_meta`: size, build time, checksums, function check, cost."""
    lines = [f"{meta['spec']['widen']}x wide, {meta['layers']} layers: "
             f"{meta['params'] / 1e9:.2f}B parameters, {meta['weights_gb']:.1f} GB "
             f"{meta['dtype']} on {meta['device']}, grown in {meta['build_s']:.1f} s",
             "", "| model | checksum | expected | match |", "|---|---|---|---|"]
    lines += [f"| {n} | {c['found']} | {c['expected']} | {c['match']} |"
              for n, c in meta["checksums"].items()]
    lines += ["", "function check (against the small models): "
              + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in meta["function_check"].items())]
    cost = meta.get("cost")
    if cost:
        ns = list(cost["target_ms"])
        lines += ["", f"forward cost at batch 1 after a {cost['prefix']}-token prefix (median "
                  f"of {cost['repeats']}):", "",
                  "| new tokens | " + " | ".join(ns) + " |", "|---" * (len(ns) + 1) + "|",
                  "| ms | " + " | ".join(f"{cost['target_ms'][n]:.2f}" for n in ns) + " |",
                  "| x one token | " + " | ".join(f"{cost['target_ratio'][n]:.3f}" for n in ns)
                  + " |"]
        if "eagle_ms" in cost:
            lines.append(f"\nfirst EAGLE drafter: {cost['eagle_ms']:.2f} ms per 1-token "
                         f"forward = {cost['eagle_vs_target']:.3f} of a target forward")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the report (see the module docstring); 0 without a GPU, else 0 when every
    step finished with status 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_report")
    ap.add_argument("--budget-s", type=float, default=600.0, help="all steps together")
    ap.add_argument("--pair", action="append", default=None,
                    help="bench pairs (default: reference and reference-large)")
    ap.add_argument("--prompts", type=int, default=8, help="bench prompts at batch 1")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--test-args", default="",
                    help="extra pytest arguments, e.g. '-n 4 --dist loadfile' with "
                         "pytest-xdist installed")
    ap.add_argument("--offline", action="store_true",
                    help="the Ray-free part only (speclab gpu-bundle's script): the Ray-free "
                         "CUDA tests, bench on reference-xl eager, the batched engine compiled")
    ap.add_argument("--rehearse", action="store_true",
                    help="with --offline: run the steps on the CPU in float32 (no CUDA needed)")
    ap.add_argument("--xl", default="24x16", help="with --offline: reference-xl's WIDENxDEPTH")
    ap.add_argument("--xl-checksums", default=None, help="with --offline: checksums.json")
    ap.add_argument("--eagle", action="append", default=[],
                    help="with --offline: an EAGLE drafter for the small reference target, "
                         "grown with reference-xl (repeat)")
    args = ap.parse_args(argv)
    if args.rehearse and not args.offline:
        ap.error("--rehearse: only with --offline")
    gpu = "CPU rehearsal (no CUDA)" if args.rehearse else cuda_device()
    if gpu is None:
        print("gpu-report: no CUDA GPU on this machine; nothing to run (exit 0)")
        return 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    steps, bench_dirs, batch_dirs = (offline_steps if args.offline else full_steps)(args, out)
    log_path = out / "cuda_tests.jsonl"
    results, deadline, saved = [], time.perf_counter() + args.budget_s, 0.0
    for name, cmd, share in steps:  # a step may use its share plus what earlier ones saved
        budget = min(deadline - time.perf_counter(), share * args.budget_s + saved)
        print(f"gpu-report: {name} ({budget:.0f} s budget)", flush=True)
        if name == "cuda_tests":
            log_path.unlink(missing_ok=True)
            results.append(run_step(name, cmd, budget, out, {"SPECLAB_TEST_LOG": str(log_path)},
                                    finished=lambda: all_reported(log_path)))
        else:
            results.append(run_step(name, cmd, budget, out))
        saved = max(budget - results[-1]["wall_s"], 0.0)
    shutil.rmtree(PYTEST_BASETEMP, ignore_errors=True)
    collected, tests = read_test_log(log_path)
    report = {"gpu": gpu, "steps": results, "cuda_tests": tests,
              "bench": {p: bench_rows(d / "bench.json") for p, d in bench_dirs.items()},
              "batch": {m: bench_rows(d / "batch_bench.json") for m, d in batch_dirs.items()},
              "reference_xl": xl_meta([*bench_dirs.values(), *batch_dirs.values()])}
    (out / "gpu_report.json").write_text(json.dumps(report, indent=2, default=str))
    counts = {k: sum(t["outcome"] == k for t in tests)
              for k in ("passed", "failed", "error", "skipped")}
    counts["collected"] = collected
    md = [f"# GPU report: {gpu}\n", "## Steps\n",
          markdown(results, ("step", "returncode", "wall_s", "log")),
          f"\n## CUDA tests: {counts}\n", markdown(tests, ("test", "outcome", "seconds"))]
    md += [f"\n### {t['test']} ({t['outcome']})\n\n```\n{t['error']}\n```\n"
           for t in tests if t.get("error")]
    if report["reference_xl"]:
        md += ["\n## reference-xl\n", xl_section(report["reference_xl"])]
    for pair, rows in report["bench"].items():
        md += [f"\n## Benchmark: {pair} (batch 1)\n", markdown(rows, BENCH_COLUMNS)]
    for mode, rows in report["batch"].items():
        md += [f"\n## Batched engine, {mode}\n", markdown(rows, BATCH_COLUMNS)]
    (out / "gpu_report.md").write_text("".join(md))
    print("".join(md))
    print(f"gpu-report: wrote {out / 'gpu_report.md'} and gpu_report.json")
    failed = [r for r in results if r["returncode"] != 0]
    for r in failed:  # last, where a reader of the output's tail looks
        print(f"gpu-report: step {r['step']} ended with {r['returncode']} after "
              f"{r['wall_s']} s; its log: {r['log']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
