"""``speclab gpu-bundle``: the folder an offline GPU machine gets, built through the CLI,
and its one script rehearsed on this CPU (``REHEARSE=1 sh run.sh``) with only what the
bundle carries on the path: the Ray-free tests run, ``reference-xl`` is grown and its
checksums match, and the report holds the bench rows (a tiny stand-in for the reference
pair: :func:`tests.unit.test_reference_xl.build_fake_reference_home`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_reference_xl import build_fake_reference_home

ROOT = Path(__file__).resolve().parents[2]


def failed_steps(report: Path) -> str:
    """Each report step that did not end with status 0, with the end of its log (what a
    failed rehearsal is read by: the report's own tail is the bench tables)."""
    path = report / "gpu_report.json"
    if not path.exists():
        return "no gpu_report.json\n"
    lines = []
    for step in json.loads(path.read_text())["steps"]:
        if step["returncode"] != 0:
            log = Path(step["log"])
            tail = log.read_text()[-3000:] if log.exists() else "(no log)"
            lines.append(f"step {step['step']}: returncode {step['returncode']} after "
                         f"{step['wall_s']} s\n{tail}\n")
    return "".join(lines)


@pytest.mark.slow
def test_the_gpu_bundle_is_one_folder_whose_script_runs_the_report(tmp_path):
    home = tmp_path / "home"
    small = build_fake_reference_home(home)
    env = {**os.environ, "SPECLAB_HOME": str(home)}
    bundle = tmp_path / "bundle"
    python = f"{sys.version_info.major}.{sys.version_info.minor}"  # this machine rehearses it
    # a bad --eagle is refused by name, before an existing folder is touched
    bundle.mkdir()
    (bundle / "keep.txt").write_text("mine")
    bad = subprocess.run([sys.executable, "-m", "speclab.cli", "gpu-bundle", str(bundle),
                          "--eagle", str(home)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "--eagle" in bad.stderr, bad.stderr[-2000:]
    assert (bundle / "keep.txt").read_text() == "mine"
    built = subprocess.run(
        [sys.executable, "-m", "speclab.cli", "gpu-bundle", str(bundle), "--eagle",
         small["eagle"], "--python", python, "--xl", "2x4", "--budget-s", "300"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    manifest = json.loads((bundle / "MANIFEST.json").read_text())
    assert manifest["mb"] <= 60
    files = {f["path"] for f in manifest["files"]}
    assert any(w.startswith("pydantic_core-") and f"cp{python.replace('.', '')}" in w
               for w in manifest["wheels"])
    for rel in ("run.sh", "README.md", "checksums.json", "src/platform/speclab/api.py",
                "src/tests/gpu/test_cuda_engine.py", "src/pyproject.toml",
                "drafters/eagle-tiny/config.json"):
        assert rel in files or (bundle / rel).exists(), rel
    assert any(f.startswith("home/models/reference-") and f.endswith("target/config.json")
               for f in files)
    assert not any(f.endswith((".pyc", ".png")) for f in files)
    assert set(json.loads((bundle / "checksums.json").read_text())) == {"2x4-bfloat16",
                                                                        "1x8-float32"}

    # the rehearsal: nothing of this checkout on the path, the bundle's own home
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPECLAB_HOME")}
    report = tmp_path / "report"
    ran = subprocess.run(["sh", str(bundle / "run.sh"), str(report), "300"], cwd=tmp_path,
                         env={**clean, "PYTHON": sys.executable, "REHEARSE": "1"},
                         capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, failed_steps(report) + ran.stdout[-2000:] + ran.stderr[-2000:]
    out = json.loads((report / "gpu_report.json").read_text())
    assert [s["returncode"] for s in out["steps"]] == [0, 0, 0], out["steps"]
    assert all(Path(s["command"].split()[0]).name.startswith("python") for s in out["steps"])
    xl = out["reference_xl"]
    assert xl["layers"] == 8 and {c["match"] for c in xl["checksums"].values()} == {True}
    assert xl["function_check"]["target_greedy_agreement"] == 1.0
    rows = {r["method"]: r for r in out["bench"]["reference-xl"]}
    assert {"ar", "chain(gamma=3)", "hf_assisted"} <= set(rows)
    eagle = [r for m, r in rows.items() if m.startswith("eagle eagle-tiny")]
    assert len(eagle) == 2 and all(r["tau"] >= 1.0 and r["identical_to_ar"] for r in eagle)
    assert out["batch"]["compiled"], "the batched step wrote no rows"
    md = (report / "gpu_report.md").read_text()
    assert "## reference-xl" in md and "| target |" in md and "Benchmark: reference-xl" in md


@pytest.mark.slow
def test_the_ray_part_comes_in_parts_that_join_and_install_offline(tmp_path):
    """``speclab gpu-bundle --ray``: parts of at most 60 MB; with one missing,
    ``assemble.sh`` says so; all of them join, install with pip offline, and Ray, MLflow,
    FastAPI and the Serve app import from what they carried."""
    home = tmp_path / "home"
    build_fake_reference_home(home)
    out = tmp_path / "ray"
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    built = subprocess.run([sys.executable, "-m", "speclab.cli", "gpu-bundle", str(out), "--ray",
                            "--python", python], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "SPECLAB_HOME": str(home)}, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    manifest = json.loads((out / "part-01" / "MANIFEST.json").read_text())
    parts = sorted(p.name for p in out.iterdir())
    assert parts == sorted(manifest["parts"]) and len(parts) >= 3
    assert all(sum(f.stat().st_size for f in (out / p).iterdir()) <= 60e6 for p in parts)
    names = {w.split("-")[0].lower() for w in manifest["wheels"]}
    assert {"ray", "mlflow", "fastapi", "uvicorn", "pydantic"} <= names
    assert not names & {"torch", "numpy", "transformers", "ruff", "hypothesis"}

    partial = tmp_path / "partial"  # one transfer short
    partial.mkdir()
    for p in parts[:-1]:
        shutil.copytree(out / p, partial / p)
    short = subprocess.run(["sh", str(partial / "part-01" / "assemble.sh"), str(tmp_path / "x")],
                           capture_output=True, text=True, env={**os.environ,
                                                                "PYTHON": sys.executable})
    assert short.returncode == 2 and f"of {len(parts)} parts" in short.stderr

    dest = tmp_path / "dest"
    joined = subprocess.run(["sh", str(out / "part-01" / "assemble.sh"), str(dest)],
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHON": sys.executable, "INSTALL_ONLY": "1"})
    assert joined.returncode == 0, joined.stderr[-3000:]
    where = subprocess.run(
        [sys.executable, "-c", "import ray, mlflow, fastapi, serve_apps.ingress, speclab; "
                               "print(ray.__file__, mlflow.__file__, speclab.__file__)"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
        env={**os.environ, "PYTHONPATH": f"{dest}/site:{dest}/src/platform:{dest}/src"})
    assert where.returncode == 0, where.stderr[-3000:]
    ray_file, mlflow_file, speclab_file = where.stdout.split()
    assert ray_file.startswith(str(dest / "site")) and mlflow_file.startswith(str(dest / "site"))
    assert speclab_file.startswith(str(dest / "src"))
