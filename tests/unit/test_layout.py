"""Project layout guarantees: platform/ is not a package, the engine is Ray/MLflow free,
every experiment config validates, cluster.yaml passes Ray's own schema validation."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_platform_is_not_a_package_and_stdlib_platform_works():
    assert not (ROOT / "platform" / "__init__.py").exists()
    code = "import platform, ray, torch; print(platform.system())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() in {"Linux", "Darwin", "Windows"}


def test_engine_imports_neither_ray_nor_mlflow():
    code = ("import sys, speclab.decoding.loop, speclab.drafters, speclab.api, "
            "speclab.theory, speclab.evaluation; "
            "print(any(m == 'ray' or m.startswith('ray.') for m in sys.modules), "
            "any(m == 'mlflow' or m.startswith('mlflow.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


CONFIGS = sorted((ROOT / "experiments").rglob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(ROOT)) for p in CONFIGS])
def test_every_experiment_config_validates_and_opens_with_its_command(path):
    from speclab.config import load_experiment

    first = path.read_text().splitlines()[0]
    assert first.startswith("# Run: ") and str(path.relative_to(ROOT)) in first
    cfg = load_experiment(path)  # the config model of the job the file names
    assert cfg.job in first  # jobs.<job> / speclab serve


def test_jobs_are_thin_and_never_import_each_other():
    """``jobs/<name>.py`` only calls ``speclab.pipelines.<name>.main``; every job and the
    stages they share live in the library, so ``speclab run`` needs no checkout."""
    import ast

    from speclab.pipelines import JOBS

    shims = sorted(p.stem for p in (ROOT / "jobs").glob("*.py") if p.stem != "__init__")
    assert shims == sorted(JOBS)
    for name in shims:
        tree = ast.parse((ROOT / "jobs" / f"{name}.py").read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert imported == {"sys", "jobs", f"speclab.pipelines.{name}"}, (name, imported)
    for path in (ROOT / "platform" / "speclab" / "pipelines").glob("*.py"):
        tree = ast.parse(path.read_text())
        mods = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any(m == "jobs" or m.startswith("jobs.") for m in mods), path
        jobs_used = {m.rsplit(".", 1)[1] for m in mods if m.startswith("speclab.pipelines.")}
        assert not jobs_used & set(JOBS), (path.name, jobs_used & set(JOBS))


def test_cluster_yaml_passes_ray_schema_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    validate_config(prepare_config(cfg))
    types = cfg["available_node_types"]
    assert "GPU" not in types[cfg["head_node_type"]]["resources"]
    assert any(t["resources"].get("GPU", 0) > 0 for t in types.values())
    bad = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    bad["available_node_types"]["head_cpu"]["not_a_field"] = 1
    with pytest.raises(Exception, match="not_a_field|additional"):
        validate_config(prepare_config(bad))
