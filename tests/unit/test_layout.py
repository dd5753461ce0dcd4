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
            "speclab.theory, speclab.evaluation, speclab.drafters.registry, "
            "speclab.families.eagle.drafter, speclab.families.medusa.drafter, "
            "speclab.families.specdecpp.drafter, speclab.families.registry; "
            "print(any(m == 'ray' or m.startswith('ray.') for m in sys.modules), "
            "any(m == 'mlflow' or m.startswith('mlflow.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_the_engine_imports_no_drafter():
    """``speclab.decoding`` (the engine) imports nothing from ``speclab.drafters`` or a
    family (``speclab.families``), at module level or inside a function: drafters
    implement the engine's interfaces, never the other way round."""
    from tests.layout_metrics import import_graph

    graph, _ = import_graph()
    engine = {m: deps for m, deps in graph.items() if m.startswith("speclab.decoding")}
    assert len(engine) > 10
    bad = {m: sorted(d for d in deps if d.startswith(("speclab.drafters", "speclab.families")))
           for m, deps in engine.items()}
    assert not {m: d for m, d in bad.items() if d}


def test_architecture_bounds():
    """Issue 52's bounds, counted by :mod:`tests.layout_metrics`: comparisons against a
    family or objective name outside ``speclab.families`` (at most 5), import circles
    (at most 2) and function-level imports of project modules (at most 200)."""
    from tests.layout_metrics import circles, family_comparisons, import_graph

    graph, lazy = import_graph()
    assert len(family_comparisons()) <= 5, family_comparisons()
    assert len(circles(graph)) <= 2, circles(graph)
    assert len(lazy) <= 200


def test_layout_metrics_count_what_they_claim(tmp_path):
    """The counters see a planted comparison, circle and lazy import."""
    import ast

    from tests.layout_metrics import _names, circles

    assert circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    node = ast.parse('x in ("eagle", "hass")').body[0].value
    assert _names(node.comparators[0]) == {"eagle", "hass"}


CONFIGS = sorted((ROOT / "experiments").rglob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(ROOT)) for p in CONFIGS])
def test_every_experiment_config_validates_and_opens_with_its_command(path):
    from speclab.config import load_experiment

    first = path.read_text().splitlines()[0]
    assert first.startswith("# Run: ") and str(path.relative_to(ROOT)) in first
    cfg = load_experiment(path)  # the config model of the job the file names
    assert cfg.job in first  # jobs.<job> / speclab serve


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (``import x`` and ``from x import y``: ``x``)."""
    import ast

    tree = ast.parse(path.read_text())
    mods = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    return mods | {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}


def test_jobs_are_thin_and_never_import_each_other():
    """``jobs/<name>.py`` only calls ``speclab.jobs.<name>.main``; every job lives in
    ``speclab/jobs/`` (a module with ``main``) and the stages they share in
    ``speclab/pipelines/`` (no ``main``), so ``speclab run`` needs no checkout and where a
    module lives tells a job from a stage."""
    import ast

    from speclab.jobs import JOBS

    lib = ROOT / "platform" / "speclab"
    shims = sorted(p.stem for p in (ROOT / "jobs").glob("*.py") if p.stem != "__init__")
    assert shims == sorted(JOBS)
    entries = sorted(p.stem for p in (lib / "jobs").glob("*.py") if p.stem != "__init__")
    assert entries == sorted(JOBS)
    for name in shims:
        assert _imports(ROOT / "jobs" / f"{name}.py") == {"sys", "jobs", f"speclab.jobs.{name}"}
    for path in [*(lib / "jobs").glob("*.py"), *(lib / "pipelines").glob("*.py")]:
        mods = _imports(path)
        assert not any(m == "jobs" or m.startswith("jobs.") for m in mods), path
        jobs_used = {m for m in mods if m.startswith("speclab.jobs")}
        assert not jobs_used, (path.relative_to(lib), jobs_used)  # not even JOBS: no cycles
        tree = ast.parse(path.read_text())
        has_main = any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)
        assert has_main == (path.parent.name == "jobs" and path.stem != "__init__"), path


def _readme_layout() -> dict[Path, str]:
    """Every path the Layout block of docs/layout.md names -> the line naming it.

    An entry (a name at the start of a line, indented 2 per level under its parent
    directory) is a path relative to its parent entry (the root for the first level). A
    name in an entry's description (``x.py``, ``x.yaml``, ``dir/``; code in backticks
    aside) is relative to the entry's directory or, failing that, one of its ancestors
    (``platform/`` in the description of ``platform/speclab/``)."""
    import re

    text = (ROOT / "docs" / "layout.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```\w*\n(.*?)```", section, re.S).group(1)
    mention = re.compile(r"(?<![\w./$<>-])([\w-]+(?:/[\w.-]+)*(?:\.py|\.yaml|/))(?=[\s,):;+]|$)")
    named: dict[Path, str] = {}
    stack: list[tuple[int, Path]] = []  # (indent, path) of the open entries
    for line in block.splitlines():
        if not line.strip():
            continue
        m = re.match(r"( *)(\S+)(?: {2,}(.*))?$", line)
        indent, desc = len(line) - len(line.lstrip(" ")), line
        if indent <= 8:  # an entry (its name, then 2+ spaces); descriptions start further right
            assert m, f"docs/layout.md Layout: an entry line without its name first: {line!r}"
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = (stack[-1][1] if stack else ROOT) / m.group(2).rstrip("/")
            named[path] = line
            stack.append((indent, path))
            desc = m.group(3) or ""
        assert stack, f"docs/layout.md Layout: a description before any entry: {line!r}"
        entry = stack[-1][1]
        base = entry if entry.is_dir() else entry.parent
        for name in mention.findall(re.sub(r"`[^`]*`", "", desc)):
            here = [d / name.rstrip("/") for d in (base, *base.parents) if d.is_relative_to(ROOT)]
            named[next((c for c in here if c.exists()), here[0])] = line
    return named


def test_readme_layout_names_only_paths_that_exist():
    """The Layout block of docs/layout.md cannot drift from the tree: every path it names exists,
    and every package directory of ``platform/speclab`` is in it."""
    named = _readme_layout()
    assert ROOT / "platform" / "speclab" / "decoding" / "rules" in named  # parsed deep
    missing = {str(p.relative_to(ROOT)): line.strip() for p, line in named.items()
               if not p.exists()}
    assert not missing, f"docs/layout.md Layout names paths that do not exist: {missing}"
    lib = ROOT / "platform" / "speclab"
    packages = {p.parent for p in lib.rglob("__init__.py") if "__pycache__" not in p.parts}
    absent = sorted(str(p.relative_to(ROOT)) for p in packages - set(named) - {lib})
    assert not absent, f"docs/layout.md Layout omits these packages: {absent}"
    assert lib in named


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
