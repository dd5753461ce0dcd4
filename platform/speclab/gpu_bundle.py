"""``speclab gpu-bundle OUT``: the GPU report for an offline machine that has only PyTorch.

The GPU machines users (and this project) get are often air-gapped: CUDA, PyTorch,
transformers, numpy, scipy, pytest, psutil, PyYAML, but no pydantic, Ray, MLflow or
FastAPI, and no package registry. This writes a folder (at most :data:`MAX_MB`) that
runs the Ray-free part of ``make gpu-report`` there in one call:

    speclab gpu-bundle gpu_bundle --eagle DIR [--eagle DIR ...]   # here, with a registry
    sh gpu_bundle/run.sh [REPORT_DIR] [BUDGET_S]                  # there

What it carries (``MANIFEST.json`` lists every file with its size):

* ``wheels/``: the dependencies the Ray-free code needs and such a machine lacks
  (:data:`OFFLINE_REQUIREMENTS`, versions from ``constraints.txt``), for the machine's
  Python and platform (``--python``, ``--platform``: default CPython 3.12, manylinux
  x86_64); ``run.sh`` unpacks them (a wheel is a zip: no pip needed);
* ``src/``: the ``speclab`` package (Python files only) and the Ray-free CUDA tests
  (:data:`RAY_FREE_TESTS`) with the files they import;
* ``home/models/reference-<hash>/``: the reference pair (3M + 0.2M parameters), and
  ``drafters/``: the EAGLE / EAGLE-3 drafters given with ``--eagle`` (trained against
  the reference target): the small models that cannot be rebuilt there;
* ``checksums.json``: the checksums ``reference-xl`` (the GPU-scale target, 5.45B
  parameters at 24x16) and its grown drafters must have once the device has grown them
  from those small models (:func:`speclab.reference_xl.expected_checksums`, computed
  here one tensor at a time), for the GPU spec in bfloat16 and the rehearsal's spec;
* ``run.sh``: the one script: :mod:`speclab.gpu_report` ``--offline`` (the Ray-free CUDA
  tests, then the batched engine compiled on ``reference-xl``, EAGLE drafters included,
  then ``speclab bench`` on it eager), writing ``gpu_report.md`` / ``gpu_report.json``
  and the bench JSONs.
  ``REHEARSE=1 sh run.sh`` runs the same steps on a host without CUDA, on a small
  ``reference-xl`` (:data:`REHEARSAL_XL`) in float32, to try the bundle before a GPU run.

The Ray / Serve / Train / Tune CUDA tests need Ray (its wheel alone is 79 MB), MLflow
and FastAPI: 180 MB of wheels, more than one transfer. ``speclab gpu-bundle OUT --ray``
writes them as a second bundle in parts (:func:`build_ray_parts`): ``OUT/part-01``,
``part-02``, ... each at most :data:`MAX_MB`, carried one transfer at a time into one
folder there; ``sh part-01/assemble.sh DEST`` joins them, installs the wheels into
``DEST/site`` (``pip --no-index``) and runs the whole ``make gpu-report`` from the
checkout it carries.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from speclab.models.reference import ensure_reference_pair
from speclab.paths import repo_root
from speclab.reference_xl import XLSpec, checksum_key, expected_checksums

#: the most the bundle may weigh (what reaches such a machine: a 64 MB folder)
MAX_MB = 60.0
#: the Ray-free code's dependencies that an offline PyTorch machine lacks
OFFLINE_REQUIREMENTS = ("pydantic", "pydantic_core", "annotated-types", "typing-inspection",
                        "typing_extensions")
#: the CUDA tests that need no Ray, MLflow or FastAPI
RAY_FREE_TESTS = ("tests/gpu/test_cuda_engine.py", "tests/gpu/test_cuda_sampling.py",
                  "tests/gpu/test_cuda_readiness.py", "tests/gpu/test_cuda_timing.py",
                  "tests/gpu/test_cuda_compile.py")
#: tests in those files that need Ray all the same (Serve's deployments): deselected
RAY_TESTS_THERE = ("tests/gpu/test_cuda_timing.py::test_serve_target_split_on_cuda",)
#: the test-tree files those tests import (conftests, the shared sampling cases)
TEST_SUPPORT = ("tests/__init__.py", "tests/conftest.py", "tests/gpu/__init__.py",
                "tests/gpu/conftest.py", "tests/integration/__init__.py",
                "tests/integration/conftest.py", "tests/unit/__init__.py",
                "tests/unit/test_engine_sampling.py")
#: the grown target on the GPU, and the rehearsal's (float32 on a CPU: the same code in
#: seconds; widen 1 keeps the width, depth 8 still inserts layers)
GPU_XL, REHEARSAL_XL = XLSpec(24, 16), XLSpec(1, 8)


def _norm(name: str) -> str:
    """A project name as pip compares them (case and ``_`` / ``-`` aside)."""
    return name.strip().lower().replace("_", "-")


def constraint_pins(constraints: Path) -> dict[str, str]:
    """Every ``name==version`` line of ``constraints`` (a pip constraints file, comments
    aside), by the normalised project name."""
    pins = {}
    for line in constraints.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            pins[_norm(line.split("==", 1)[0])] = line
    return pins


def pinned(names: tuple[str, ...], constraints: Path) -> list[str]:
    """``name==version`` for each of ``names`` from ``constraints``; a name it does not
    pin is a ValueError."""
    pins = constraint_pins(constraints)
    missing = [n for n in names if _norm(n) not in pins]
    if missing:
        raise ValueError(f"constraints: {constraints} pins no version of {missing}")
    return [pins[_norm(n)] for n in names]


def download_wheels(out: Path, python: str, platform: str, constraints: Path) -> list[str]:
    """``pip download`` :data:`OFFLINE_REQUIREMENTS` as binary wheels for CPython
    ``python`` on ``platform`` into ``out`` (no dependencies resolved: the list is
    complete for the Ray-free code). Returns the wheel files' names."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", "--platform", platform,
           "--dest", str(out), *pinned(OFFLINE_REQUIREMENTS, constraints)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"gpu-bundle: pip download failed ({done.returncode}): "
                           f"{done.stderr.strip()[-2000:]}")
    return sorted(p.name for p in out.glob("*.whl"))


def copy_sources(root: Path, dst: Path) -> None:
    """The ``speclab`` package (``.py`` files), the Ray-free CUDA tests and their support
    files, and ``pyproject.toml`` (pytest's settings), under ``dst``."""
    pkg = root / "platform" / "speclab"
    for f in pkg.rglob("*.py"):
        target = dst / "platform" / "speclab" / f.relative_to(pkg)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, target)
    for rel in (*RAY_FREE_TESTS, *TEST_SUPPORT, "pyproject.toml"):
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)


RUN_SH = """#!/bin/sh
# The Ray-free GPU report of speclab (written by `speclab gpu-bundle`; README.md says more).
#   sh run.sh [REPORT_DIR] [BUDGET_S]     on a machine with CUDA PyTorch, offline
#   REHEARSE=1 sh run.sh [REPORT_DIR]     the same steps on a CPU, on a small reference-xl
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
REPORT=${{1:-$HERE/report}}
BUDGET=${{2:-{budget}}}
PY=${{PYTHON:-python3}}
if [ ! -f "$HERE/site/.unpacked" ]; then
  mkdir -p "$HERE/site"
  for w in "$HERE"/wheels/*.whl; do "$PY" -m zipfile -e "$w" "$HERE/site"; done
  touch "$HERE/site/.unpacked"
fi
export PYTHONPATH="$HERE/site:$HERE/src/platform:$HERE/src"
export SPECLAB_HOME="$HERE/home" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
EAGLES="{eagles}"
set --
for e in $EAGLES; do set -- "$@" --eagle "$HERE/drafters/$e"; done
cd "$HERE/src"
if [ -n "${{REHEARSE:-}}" ]; then
  exec "$PY" -m speclab.gpu_report --offline --rehearse --out "$REPORT" --budget-s "$BUDGET" \\
    --xl {rehearsal} --xl-checksums "$HERE/checksums.json" "$@"
fi
exec "$PY" -m speclab.gpu_report --offline --out "$REPORT" --budget-s "$BUDGET" \\
  --xl {xl} --xl-checksums "$HERE/checksums.json" "$@"
"""

README = """# speclab GPU bundle

Written by `speclab gpu-bundle` on {built} from speclab at `{commit}`.

    sh run.sh [REPORT_DIR] [BUDGET_S]      # default: ./report, {budget} s for its steps

On a machine with CUDA PyTorch and transformers (no registry, no Ray, MLflow or FastAPI)
it runs, each step in a subprocess with its share of the budget:

1. the Ray-free CUDA tests ({tests});
2. the batched engine compiled (static caches, CUDA graphs) at batch 1 on
   `reference-xl` ({xl}: the reference target widened {widen}x and deepened to {depth}
   layers, grown on the GPU from the small target carried here, checked against
   `checksums.json`): AR, the standalone draft's chains and SALF, each EAGLE drafter in
   `drafters/` grown the same way (EAGLE-2 tree), each timed in pairs with AR;
3. `speclab bench --pair reference-xl` eager in bfloat16: the target's forward cost for
   1/4/8/16 new tokens, then AR, chains and the standalone draft's tree, each EAGLE
   drafter (EAGLE-2 tree and optimal tree), and Hugging Face assisted generation.

It writes `REPORT_DIR/gpu_report.md` and `gpu_report.json` (every step's command, exit
status, wall time, test outcomes and bench rows) and each bench's JSON.
`REHEARSE=1 sh run.sh` runs the same steps on a CPU on a small `reference-xl` ({rehearsal},
float32).

Carried (`MANIFEST.json` lists every file and the total size): wheels ({wheels}), the
speclab sources and tests, the reference pair and the drafters ({drafters}).

## The Ray / Serve / Train / Tune CUDA tests (not in this bundle)

`tests/gpu/test_cuda_{{train,serve,tune}}.py` need Ray 2.60 (its wheel alone is 79 MB),
MLflow, FastAPI and their dependencies: more than one 64 MB transfer. They come as a
second bundle in parts: `speclab gpu-bundle OUT --ray` writes `OUT/part-01`, `part-02`,
... (each at most 60 MB); carry them one transfer at a time into one folder, then
`sh part-01/assemble.sh DEST [REPORT_DIR]` joins them, installs the wheels into
`DEST/site` (`pip install --no-index --no-deps --target`) and runs the whole report
(`python -m speclab.gpu_report`: every CUDA test and the benches) from the checkout
the parts carry.
"""


def file_list(out: Path) -> list[dict]:
    """Every file under ``out`` with its size, sorted by path."""
    return [{"path": str(f.relative_to(out)), "bytes": f.stat().st_size}
            for f in sorted(out.rglob("*")) if f.is_file()]


def build_bundle(out: Path, eagles: list[str], python: str = "3.12",
                 platform: str = "manylinux2014_x86_64", xl: XLSpec = GPU_XL,
                 budget_s: int = 460, log=print) -> dict:
    """Write the bundle (module docstring) to ``out`` (replaced if it exists); returns
    the manifest. A bundle over :data:`MAX_MB` is removed and refused."""
    names = [Path(e).name for e in eagles]  # refused before anything is removed
    if len(set(names)) != len(names):
        raise ValueError(f"--eagle: the drafters' folder names must differ, got {names}")
    for e in eagles:
        if not (Path(e) / "config.json").is_file():
            raise ValueError(f"--eagle: {e} is not a drafter folder (no config.json)")
    root = repo_root()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    wheels = download_wheels(out / "wheels", python, platform, root / "constraints.txt")
    log(f"gpu-bundle: {len(wheels)} wheels for CPython {python} on {platform}")
    copy_sources(root, out / "src")
    pair = ensure_reference_pair()
    models = Path(pair.target).parent  # reference-<hash>: found there by its name
    shutil.copytree(models, out / "home" / "models" / models.name)
    for e in eagles:
        shutil.copytree(e, out / "drafters" / Path(e).name)
    log("gpu-bundle: computing reference-xl's checksums on this host (one tensor at a time)")
    sums = {}
    for spec, dtype in ((xl, "bfloat16"), (REHEARSAL_XL, "float32")):
        t1 = time.perf_counter()
        sums[checksum_key(spec, dtype)] = expected_checksums(pair.target, eagles, spec, dtype)
        log(f"gpu-bundle: {checksum_key(spec, dtype)}: {sums[checksum_key(spec, dtype)]} "
            f"({time.perf_counter() - t1:.0f}s)")
    (out / "checksums.json").write_text(json.dumps(sums, indent=2))
    (out / "run.sh").write_text(RUN_SH.format(budget=budget_s, eagles=" ".join(names),
                                              xl=xl.name, rehearsal=REHEARSAL_XL.name))
    (out / "run.sh").chmod(0o755)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                            capture_output=True, text=True).stdout.strip() or "unknown"
    (out / "README.md").write_text(README.format(
        built=time.strftime("%Y-%m-%d %H:%M"), commit=commit, budget=budget_s,
        tests=", ".join(Path(t).name for t in RAY_FREE_TESTS), xl=xl.name, widen=xl.widen,
        depth=xl.depth, rehearsal=REHEARSAL_XL.name, wheels=", ".join(wheels),
        drafters=", ".join(names) or "none"))
    files = file_list(out)
    mb = sum(f["bytes"] for f in files) / 1e6
    manifest = {"python": python, "platform": platform, "xl": xl.name, "mb": round(mb, 2),
                "wheels": wheels, "drafters": names, "checksums": sums,
                "build_s": round(time.perf_counter() - t0, 1), "files": files}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2))
    if mb > MAX_MB:
        shutil.rmtree(out)
        raise ValueError(f"gpu-bundle: {mb:.1f} MB is over the {MAX_MB:.0f} MB a transfer "
                         "may carry (fewer --eagle drafters?)")
    log(f"gpu-bundle: wrote {out} ({len(files)} files, {mb:.1f} MB, "
        f"{manifest['build_s']:.0f}s); run it with: sh {out}/run.sh")
    return manifest


# --- the second bundle: the Ray part, in parts -----------------------------------------------

#: what an offline PyTorch GPU machine has (CUDA PyTorch, transformers, pytest, numpy,
#: scipy, pandas, pyarrow, psutil, PyYAML, safetensors, tokenizers) and their
#: dependencies: not carried in the Ray part
DEVICE_HAS = frozenset({
    "torch", "transformers", "tokenizers", "safetensors", "huggingface-hub", "hf-xet", "numpy",
    "scipy", "pandas", "pyarrow", "psutil", "pyyaml", "pytest", "pluggy", "iniconfig",
    "filelock", "fsspec", "regex", "tqdm", "packaging", "jinja2", "markupsafe", "networkx",
    "sympy", "mpmath", "python-dateutil", "six"})
#: what only development needs (lint, docs, property tests, the LangChain client test,
#: profiling): not carried either
DEV_ONLY = frozenset({
    "ruff", "hypothesis", "mkdocs", "mkdocs-get-deps", "ghp-import", "mergedeep", "markdown",
    "pyyaml-env-tag", "watchdog", "langchain-core", "langchain-openai", "langchain-protocol",
    "langsmith", "py-spy", "sortedcontainers", "pygments", "rich", "markdown-it-py", "mdurl"})
#: the wheel platform tags a manylinux x86_64 machine takes, newest last
MANYLINUX = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")


def ray_part_pins(constraints: Path) -> list[str]:
    """``name==version`` of every package ``constraints`` pins (the tested set) but
    :data:`DEVICE_HAS` and :data:`DEV_ONLY`: the Ray part's wheels."""
    return [line for name, line in constraint_pins(constraints).items()
            if name not in DEVICE_HAS | DEV_ONLY]


ASSEMBLE_SH = """#!/bin/sh
# The Ray / Serve / Train / Tune part of speclab's GPU report (`speclab gpu-bundle --ray`).
#   sh part-01/assemble.sh DEST [REPORT_DIR]    once every part-NN folder sits beside part-01
#   INSTALL_ONLY=1 sh part-01/assemble.sh DEST  join and install, run nothing
set -eu
HERE=$(cd "$(dirname "$0")/.." && pwd)
DEST=${{1:?usage: sh assemble.sh DEST [REPORT_DIR]}}
PY=${{PYTHON:-python3}}
n=$(ls -d "$HERE"/part-* | wc -l)
if [ "$n" -ne {parts} ]; then echo "assemble: $n of {parts} parts in $HERE" >&2; exit 2; fi
mkdir -p "$DEST"
cat "$HERE"/part-*/ray_part.tar.* | tar xf - -C "$DEST"
"$PY" -m pip install --quiet --no-index --no-deps --target "$DEST/site" "$DEST"/wheels/*.whl
export PYTHONPATH="$DEST/site:$DEST/src/platform:$DEST/src" SPECLAB_HOME="$DEST/home"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
if [ -n "${{INSTALL_ONLY:-}}" ]; then exit 0; fi
cd "$DEST/src"
exec "$PY" -m speclab.gpu_report --out "${{2:-$DEST/report}}"
"""


def build_ray_parts(out: Path, python: str = "3.12", part_mb: float = MAX_MB,
                    log=print) -> dict:
    """Write the Ray part (module docstring) to ``out`` (replaced if it exists): the
    wheels of :func:`ray_part_pins` for CPython ``python`` on manylinux x86_64, this
    checkout's tracked files and the reference pair, as one tar cut into
    ``out/part-NN/ray_part.tar.NN`` of at most ``part_mb`` MB each, ``part-01`` also
    holding ``assemble.sh``. Returns the manifest (``out/MANIFEST.json``)."""
    import tarfile

    root = repo_root()
    if out.exists():
        shutil.rmtree(out)
    stage = out.with_name(out.name + ".stage")
    if stage.exists():
        shutil.rmtree(stage)
    t0 = time.perf_counter()
    pins = ray_part_pins(root / "constraints.txt")
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp",
           *[x for p in MANYLINUX for x in ("--platform", p)], "--dest", str(stage / "wheels"),
           *pins]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"gpu-bundle --ray: pip download failed ({done.returncode}): "
                           f"{done.stderr.strip()[-2000:]}")
    wheels = sorted(p.name for p in (stage / "wheels").glob("*.whl"))
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True,
                             check=True).stdout.decode().split("\0")
    for rel in filter(None, tracked):
        if (root / rel).is_file():
            (stage / "src" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, stage / "src" / rel)
    models = Path(ensure_reference_pair().target).parent
    shutil.copytree(models, stage / "home" / "models" / models.name)
    tar = stage.with_suffix(".tar")
    with tarfile.open(tar, "w") as tf:
        for top in ("wheels", "src", "home"):
            tf.add(stage / top, arcname=top)
    shutil.rmtree(stage)
    # 100 kB of room per part: part-01 also holds assemble.sh and MANIFEST.json
    size, chunk, parts = tar.stat().st_size, int(part_mb * 1e6) - 100_000, []
    with tar.open("rb") as f:
        for i in range(1, -(-size // chunk) + 1):
            folder = out / f"part-{i:02d}"
            folder.mkdir(parents=True)
            (folder / f"ray_part.tar.{i:02d}").write_bytes(f.read(chunk))
            parts.append(folder.name)
    tar.unlink()
    (out / "part-01" / "assemble.sh").write_text(ASSEMBLE_SH.format(parts=len(parts)))
    manifest = {"python": python, "platforms": list(MANYLINUX), "wheels": wheels,
                "parts": {p: sum(f.stat().st_size for f in (out / p).iterdir()) for p in parts},
                "mb": round(size / 1e6, 2), "build_s": round(time.perf_counter() - t0, 1)}
    (out / "part-01" / "MANIFEST.json").write_text(json.dumps(manifest, indent=2))
    log(f"gpu-bundle --ray: {len(wheels)} wheels and the checkout, {manifest['mb']:.0f} MB in "
        f"{len(parts)} parts under {out} ({manifest['build_s']:.0f}s); there: sh "
        "part-01/assemble.sh DEST")
    return manifest
