"""``make gpu-report`` on a machine without a GPU, and how it reads its steps' output."""

import json

import torch

from speclab import gpu_report


def test_without_a_gpu_it_says_so_and_exits_0(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_report.main(["--out", str(tmp_path / "r")]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out
    assert not (tmp_path / "r").exists()


def test_reads_junit_and_bench_json_into_tables(tmp_path):
    (tmp_path / "t.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.gpu.a" name="ok" time="1.5"/>'
        '<testcase classname="tests.gpu.a" name="bad" time="2"><failure/></testcase>'
        '<testcase classname="tests.gpu.b" name="skip" time="0"><skipped/></testcase>'
        '</testsuite></testsuites>')
    tests = gpu_report.junit_results(tmp_path / "t.xml")
    assert [t["outcome"] for t in tests] == ["passed", "failed", "skipped"]
    (tmp_path / "bench.json").write_text(json.dumps(
        {"rows": [{"method": "chain", "tau": 2.5, "speedup": 1.8, "other": 1}]}))
    rows = gpu_report.bench_rows(tmp_path / "bench.json")
    table = gpu_report.markdown(rows, gpu_report.BENCH_COLUMNS)
    assert table.splitlines()[0] == "| method | tau | speedup |"
    assert "| chain | 2.5 | 1.8 |" in table
    assert gpu_report.bench_rows(tmp_path / "missing.json") == []
