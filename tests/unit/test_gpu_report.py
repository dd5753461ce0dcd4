"""``make gpu-report`` on a machine without a GPU, and how it reads its steps' output."""

import json

import torch

from speclab import gpu_report


def test_without_a_gpu_it_says_so_and_exits_0(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_report.main(["--out", str(tmp_path / "r")]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out
    assert not (tmp_path / "r").exists()


def test_reads_the_test_log_and_bench_json_into_tables(tmp_path):
    log = tmp_path / "t.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in [
        {"collected": 3},
        {"test": "tests/gpu/a.py::ok", "phase": "call", "outcome": "passed", "seconds": 1.5},
        {"test": "tests/gpu/a.py::bad", "phase": "call", "outcome": "failed", "seconds": 2,
         "error": "AssertionError"}]) + "\n")
    assert not gpu_report.all_reported(log)
    with log.open("a") as f:
        f.write(json.dumps({"test": "tests/gpu/b.py::skip", "phase": "setup",
                            "outcome": "skipped", "seconds": 0}) + "\n")
    collected, tests = gpu_report.read_test_log(log)
    assert collected == 3 and gpu_report.all_reported(log)
    assert [t["outcome"] for t in tests] == ["passed", "failed", "skipped"]
    (tmp_path / "bench.json").write_text(json.dumps(
        {"rows": [{"method": "chain", "tau": 2.5, "speedup": 1.8, "other": 1}]}))
    rows = gpu_report.bench_rows(tmp_path / "bench.json")
    table = gpu_report.markdown(rows, gpu_report.BENCH_COLUMNS)
    assert table.splitlines()[0] == "| method | tau | speedup |"
    assert "| chain | 2.5 | 1.8 |" in table
    assert gpu_report.bench_rows(tmp_path / "missing.json") == []
    # a bfloat16 row whose outputs differ by near ties says so (speclab.agreement)
    tied = gpu_report.markdown([{"method": "tree", "identical_to_ar": False, "near_ties": 3,
                                 "differing": 0}], gpu_report.BENCH_COLUMNS)
    assert "| tree | False | 3 | 0 |" in tied


def test_a_step_that_hangs_after_its_work_is_stopped_and_named(tmp_path):
    """``finished()`` true while the process still runs: stopped after the exit grace;
    a step past its timeout: stopped, named ``timeout``; both by their SIGINT, well
    before its 20 s grace, even when this test itself runs with SIGINT ignored (a shell's
    background job: the step gets SIGINT's default action back)."""
    import sys

    ready = tmp_path / "ready"
    sleeper = ("import pathlib, sys, time; pathlib.Path(sys.argv[1]).touch(); "
               "time.sleep(60)")
    r = gpu_report.run_step("hang", [sys.executable, "-c", sleeper, str(ready)], 30, tmp_path,
                            finished=ready.exists, exit_grace_s=1.0)
    assert r["returncode"] == "hung at exit" and r["wall_s"] < 10
    r = gpu_report.run_step("slow", [sys.executable, "-c", "import time; time.sleep(60)"],
                            1, tmp_path)
    assert r["returncode"] == "timeout" and r["wall_s"] < 10


def test_the_cuda_tests_log_their_outcomes_as_they_run(tmp_path):
    """The conftest hook writes one record per test (here on the CPU, where the CUDA
    tests skip): what the report reads when a session is stopped before its end."""
    import os
    import subprocess
    import sys

    log = tmp_path / "log.jsonl"
    # a session of its own, with this process's environment: under pytest-xdist that
    # holds PYTEST_XDIST_WORKER, which must not make the new session leave its log to a
    # controller it does not have (the hook asks its own config whether it is a worker)
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "--basetemp", str(tmp_path / "basetemp"), "tests/gpu/test_cuda_timing.py"],
                   cwd=gpu_report.ROOT, check=False,
                   env={**os.environ, "SPECLAB_TEST_LOG": str(log),
                        "PYTEST_XDIST_WORKER": os.environ.get("PYTEST_XDIST_WORKER", "gw0")},
                   capture_output=True)
    collected, tests = gpu_report.read_test_log(log)
    assert collected and len(tests) == collected
    assert {t["outcome"] for t in tests} <= {"passed", "skipped", "failed", "error"}


def test_a_stopped_step_leaves_nothing_running(tmp_path):
    """A step's child in a session of its own (as a test's job is) is stopped with the
    step: the next step is timed on an idle machine."""
    import os
    import sys

    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(120)'], start_new_session=True); "
            "print(c.pid, flush=True); time.sleep(120)")
    r = gpu_report.run_step("orphan", [sys.executable, "-c", code], 3, tmp_path)
    assert r["returncode"] == "timeout" and "survivors" not in r
    child = int((tmp_path / "orphan.log").read_text().split()[0])
    try:
        os.kill(child, 0)
        state = open(f"/proc/{child}/stat").read().split(")")[1].split()[0]
        assert state == "Z", f"pid {child} still runs"
    except (ProcessLookupError, FileNotFoundError):
        pass


def test_a_failed_step_is_named_last_and_fails_the_report(capsys, monkeypatch, tmp_path):
    """The report's own tail is its tables: a step that ended non-zero is named after
    them (its status, wall time and log), and the report exits 1."""
    import sys

    monkeypatch.setattr(gpu_report, "cuda_device", lambda: "a fake GPU")
    steps = [("fine", [sys.executable, "-c", "pass"], 0.5),
             ("broken", [sys.executable, "-c", "import sys; sys.exit(3)"], 0.5)]
    monkeypatch.setattr(gpu_report, "full_steps", lambda args, out: (steps, {}, {}))
    assert gpu_report.main(["--out", str(tmp_path / "r"), "--budget-s", "60"]) == 1
    tail = capsys.readouterr().out.strip().splitlines()[-1]
    assert tail.startswith("gpu-report: step broken ended with 3 after ")
    assert tail.endswith(f"its log: {tmp_path / 'r' / 'broken.log'}")


def test_the_cuda_tests_keep_a_pytest_folder_of_their_own(capsys, monkeypatch, tmp_path):
    """Both reports run the CUDA tests with their own ``--basetemp``: pytest's default
    folder would have the session prune every other session's numbered folders at its
    end (a CI run's nested report was stopped as "hung at exit" in that clean-up). The
    folder is gone when the report ends."""
    import argparse

    args = argparse.Namespace(pair=None, max_new_tokens=8, prompts=2, test_args="",
                              rehearse=True, xl="2x4", xl_checksums=None, eagle=[])
    for steps in (gpu_report.full_steps, gpu_report.offline_steps):
        (name, cmd, _), *_ = steps(args, tmp_path)[0]
        assert name == "cuda_tests"
        assert cmd[cmd.index("--basetemp") + 1] == str(gpu_report.PYTEST_BASETEMP)
    monkeypatch.setattr(gpu_report, "cuda_device", lambda: "a fake GPU")
    code = f"import pathlib; pathlib.Path({str(gpu_report.PYTEST_BASETEMP)!r}).mkdir()"
    monkeypatch.setattr(gpu_report, "full_steps", lambda args, out: (
        [("makes_it", [__import__("sys").executable, "-c", code], 1.0)], {}, {}))
    assert gpu_report.main(["--out", str(tmp_path / "r"), "--budget-s", "60"]) == 0
    assert not gpu_report.PYTEST_BASETEMP.exists()
