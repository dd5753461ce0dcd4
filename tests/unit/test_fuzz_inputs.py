"""Property-based fuzzing (Hypothesis) of what users type: experiment configs (``key=value``
overrides and whole YAML documents) and the ``speclab generate`` / ``speclab recommend``
argument space. Property: every input either works or is refused with a ConfigError /
exit status 2 whose message names the field; never a traceback, never another exception.

The suite runs a fixed, derandomized sample (``SPECLAB_FUZZ_EXAMPLES`` per test, default
below); set it higher for a longer hunt, e.g. ``SPECLAB_FUZZ_EXAMPLES=3000 pytest
tests/unit/test_fuzz_inputs.py``. The HTTP routes are fuzzed in
tests/integration/test_serve.py against a running app.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speclab.config import JOB_CONFIGS, ConfigError
from speclab.pipelines.cli import load_or_exit
from speclab.tracking import flatten

ROOT = Path(__file__).resolve().parents[2]
JOBS = sorted(JOB_CONFIGS)


def fuzz_settings(default: int):
    """Derandomized (CI sees the same inputs every run), no example database on disk."""
    n = int(os.environ.get("SPECLAB_FUZZ_EXAMPLES", default))
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


def smoke(job: str) -> Path:
    return ROOT / "experiments" / "smoke" / f"{job}.yaml"


KEYS = {job: sorted(flatten(JOB_CONFIGS[job].from_yaml(smoke(job)).model_dump(mode="json")))
        for job in JOBS}

# values that are hostile to a typed config: wrong types, non-finite and huge numbers,
# YAML tags that would build Python objects, aliases, nested structures
HOSTILE = st.sampled_from([
    "!!python/object/apply:os.system ['echo pwned']", "!!python/name:os.system",
    "!!python/object/new:builtins.list [[1]]", "!!binary aGk=", "[1, {a: b}]", "{}", "[]",
    ".nan", "-.inf", ".inf", "1e999", "2020-01-01", "~", "&a [*a]", "{a: &x 1, b: *x}", "0x10",
    "1_000", "'", "[", "yes", "NaN",
])
SCALARS = st.one_of(st.integers(), st.integers(min_value=10**15, max_value=10**40),
                    st.floats(), st.text(max_size=20), st.booleans(), st.none(), HOSTILE)


def as_override_value(v) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, float):
        return repr(v)
    return yaml.safe_dump(v).strip().removesuffix("...").strip()


def refused_naming(job: str, path: Path, overrides: list[str], name: str, capsys) -> bool:
    """Load as the job does (``load_or_exit``): True if it exited 2 with ``name`` in the
    message, False if the config is valid; anything else fails the test."""
    capsys.readouterr()  # what earlier examples printed
    try:
        cfg = load_or_exit(JOB_CONFIGS[job], str(path), overrides)
    except SystemExit as exc:
        err = capsys.readouterr().err
        assert exc.code == 2, err
        assert "Traceback" not in err
        assert name in err, (name, err)
        return True
    # a valid config round-trips through its own YAML dump
    again = JOB_CONFIGS[job].from_dict(yaml.safe_load(cfg.to_yaml()))
    assert again.dump() == cfg.dump()
    return False


@fuzz_settings(500)
@given(job=st.sampled_from(JOBS), data=st.data())
def test_config_overrides(job, data, capsys):
    """``python -m jobs.<job> --config smoke.yaml key=value``: known keys (and junk keys)
    set to hostile values work or fail naming the key's group."""
    key = data.draw(st.one_of(st.sampled_from(KEYS[job]), st.text(min_size=1, max_size=12)),
                    label="key")
    value = as_override_value(data.draw(SCALARS, label="value"))
    override = f"{key}={value}"
    first = override.split("=", 1)[0].strip().split(".")[0]
    refused_naming(job, smoke(job), [override], first or "override", capsys)


LEAF = st.one_of(st.integers(), st.floats(), st.text(max_size=10), st.booleans(), st.none())
TREE = st.recursive(LEAF, lambda c: st.one_of(st.lists(c, max_size=4),
                                              st.dictionaries(st.text(max_size=8), c,
                                                              max_size=4)), max_leaves=12)
RAW_DOCS = st.one_of(st.text(max_size=200), st.sampled_from([
    "!!python/object/apply:os.system ['touch {marker}']", "!!python/name:os.system",
    "a: !!python/object/apply:os.system ['touch {marker}']", "- 1\n- 2", "42", "&a [*a, *a]",
    "a: &x 1\nb: *x", "---\na: 1\n---\nb: 2", "{", "a: [", "\t", "a:\n  - b\n c",
    "? [1,2]\n: x", "a: 1\na: 2", "", "null", "job: [evaluate]", "job: !!python/none ''",
]))


@fuzz_settings(500)
@given(job=st.sampled_from(JOBS), data=st.data())
def test_config_documents(job, data, tmp_path_factory, capsys):
    """Whole YAML documents: raw text (tags, aliases, several documents, broken syntax),
    random structures, and the job's smoke config with a random subtree replaced. Valid
    or exit 2 naming ``config`` or a field; a Python-object tag never runs."""
    tmp = tmp_path_factory.mktemp("doc")
    marker = tmp / "pwned"
    kind = data.draw(st.sampled_from(["raw", "tree", "mutated"]), label="kind")
    if kind == "raw":
        text = data.draw(RAW_DOCS, label="text").replace("{marker}", str(marker))
    elif kind == "tree":
        text = yaml.safe_dump(data.draw(TREE, label="tree"))
    else:  # the job's own config, one subtree replaced (or one unknown key added)
        doc = yaml.safe_load(smoke(job).read_text())
        node = doc
        while True:
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            if not keys:
                break
            key = data.draw(st.sampled_from(keys), label="key")
            if not isinstance(node[key], (dict, list)) or data.draw(st.booleans()):
                node[key] = data.draw(TREE, label="value")
                break
            node = node[key]
        if isinstance(node, dict) and data.draw(st.booleans()):
            node[data.draw(st.text(max_size=8), label="new key")] = data.draw(LEAF)
        text = yaml.safe_dump(copy.deepcopy(doc))
    path = tmp / "config.yaml"
    path.write_text(text)
    capsys.readouterr()
    try:
        load_or_exit(JOB_CONFIGS[job], str(path), [])
    except SystemExit as exc:
        err = capsys.readouterr().err
        assert exc.code == 2 and "Traceback" not in err, err
        assert err.startswith(f"config error in {path}:\n") and len(err.splitlines()) >= 2
    assert not marker.exists(), "a YAML tag ran code"


# ---- speclab generate / speclab recommend, in process (cli.main(argv)) ----

NUM = st.one_of(st.integers(-5, 12), st.integers(), st.floats(),
                st.sampled_from(["nan", "inf", "-inf", "1e400", "abc", "", "0x10", "1_000"]))
GOOD = {"--temperature": st.sampled_from([0, 0.5, 1.0]),
        "--top-p": st.sampled_from([1.0, 0.9, 0.5]), "--sample-top-k": st.integers(0, 10),
        "--max-new-tokens": st.integers(1, 10), "--num-samples": st.integers(1, 2),
        "--seed": st.integers(0, 2**32), "--batch-size": st.integers(1, 3)}
HUGE = (10**6, 10**18, 10**30)


def run_cli(argv: list[str]) -> tuple[int, str]:
    """``speclab <argv>`` in this process: (exit status, stderr)."""
    from speclab import cli

    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = cli.main(argv)
    except SystemExit as exc:  # argparse
        rc = exc.code
    return rc, err.getvalue()


def assert_works_or_exits_2(rc: int, err: str) -> None:
    assert rc in (0, 2), (rc, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    if rc == 2:  # a last line naming the argument / field: argparse's, or ours
        last = err.strip().splitlines()[-1]
        assert (last.startswith(("speclab: error: ", "speclab generate: error: ",
                                 "speclab recommend: error: "))
                or re.match(r"(error: )?[a-z_]+(\.[a-z_0-9]+)*: ", last)), err


@fuzz_settings(150)
@given(data=st.data())
def test_generate_arguments(tiny_pair, data):
    """Every registered method, its knob flags, sampling flags, rules, dtypes, devices and
    prompts, half of the examples drawn from valid ranges (they must decode)."""
    from speclab.cli import _knob_flags
    from speclab.config.method import methods

    d = data.draw
    clean = d(st.booleans(), label="clean")
    argv = ["generate", "--target", tiny_pair["target"]]
    if clean or d(st.booleans()):
        argv += ["--draft", tiny_pair["close"] if clean else d(st.sampled_from(
            [tiny_pair["close"], "/nonexistent/draft", str(Path(tiny_pair["close"]).parent),
             "", "models:/../../etc"]))]
    method = d(st.sampled_from(sorted(methods())), label="method")
    argv += ["--method", method]
    flags = _knob_flags()
    knobs = d(st.lists(st.sampled_from(sorted(flags)), max_size=3, unique=True), label="knobs")
    for knob in knobs:
        flag = "--" + knob.replace("_", "-")
        if clean and flags[knob]["annotation"] is bool:
            argv.append(flag if d(st.booleans()) else "--no-" + flag[2:])
        else:
            argv.append(f"{flag}={d(st.integers(1, 4) if clean else NUM, label=knob)}")
    for flag in d(st.lists(st.sampled_from(sorted(GOOD)), max_size=3, unique=True)):
        value = d(GOOD[flag] if clean else st.one_of(NUM, st.sampled_from(HUGE)), label=flag)
        argv.append(f"{flag}={value}")
    if not clean and d(st.booleans()):
        argv.append("--verify=" + d(st.sampled_from(["greedy", "sample", "typical", "x", ""])))
    if not clean and d(st.booleans()):
        argv.append("--verify-param=" + d(st.sampled_from(
            ["epsilon=0.2", "epsilon=nan", "x", "=1", "delta=-1", "epsilon=1e400"])))
    if d(st.booleans()):
        argv.append("--dtype=" + d(st.sampled_from(
            ["float32", "bfloat16"] if clean else ["float32", "float16", "int8", "x"])))
    if d(st.booleans()):
        argv.append("--device=" + d(st.sampled_from(
            ["cpu", "auto"] if clean else ["cuda", "tpu", "cuda:7", "meta", "cpu:1", ""])))
    for _ in range(d(st.integers(1, 2))):
        if clean:
            ids = d(st.lists(st.integers(0, 63), min_size=1, max_size=6), label="ids")
            argv.append("--prompt-ids=" + ",".join(map(str, ids)))
        elif d(st.booleans()):
            argv.append("--prompt-ids=" + d(st.one_of(
                st.lists(st.integers(-3, 70), max_size=5).map(lambda v: ",".join(map(str, v))),
                st.text(max_size=8), st.sampled_from(["99999999999999999999", "1,,2", "-1"]))))
        else:
            argv.append("--prompt=" + d(st.text(max_size=30)))
    rc, err = run_cli(argv)
    assert_works_or_exits_2(rc, err)
    if clean and rc == 2:  # valid values: a missing drafter file or a clash of settings,
        last = err.strip().splitlines()[-1]  # named by field, not an argparse complaint
        assert re.match(r"(error: )?[a-z_]+(\.[a-z_0-9]+)*: ", last), err[-2000:]


@fuzz_settings(150)
@given(data=st.data())
def test_recommend_arguments(rec_pair, data):
    """``speclab recommend``: histories (unknown ids, junk, huge), k / n / gamma out of
    range, both methods and rules; valid ones return k items."""
    target, draft = rec_pair
    d = data.draw
    clean = d(st.booleans(), label="clean")
    items = st.integers(100, 139)
    if clean:
        history = ",".join(map(str, d(st.lists(items, min_size=1, max_size=6))))
    else:
        history = d(st.one_of(st.lists(st.one_of(items, st.integers()), max_size=6)
                              .map(lambda v: ",".join(map(str, v))),
                              st.text(max_size=10), st.sampled_from(["", ",", "1e3", "-1"])))
    method = d(st.sampled_from(["beam", "sd"] if clean else ["beam", "sd", "x"]))
    argv = ["recommend", "--target", target, f"--history={history}", f"--method={method}"]
    if method == "sd" and (clean or d(st.booleans())):
        argv.append(f"--draft={draft}")
    for flag in d(st.lists(st.sampled_from(["--k", "--n", "--gamma", "--seed"]), max_size=3,
                           unique=True)):
        value = d(st.integers(1, 8) if clean else st.one_of(NUM, st.sampled_from(HUGE)))
        argv.append(f"{flag}={value}")
    argv.append("--verify=" + d(st.sampled_from(["strict", "relaxed"] if clean
                                                else ["strict", "relaxed", "x"])))
    rc, err = run_cli(argv + ["--json"])
    assert_works_or_exits_2(rc, err)


def test_yaml_tags_are_refused_not_run(tmp_path, capsys):
    """A config that tries to build a Python object through a YAML tag is refused as
    invalid YAML (safe_load) before anything runs."""
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.yaml"
    path.write_text(f"name: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(SystemExit) as exc:
        load_or_exit(JOB_CONFIGS["evaluate"], str(path), [])
    assert exc.value.code == 2 and not marker.exists()
    assert "is not valid YAML" in capsys.readouterr().err
    with pytest.raises(ConfigError):  # the same tag in an override stays a plain string
        JOB_CONFIGS["evaluate"].from_yaml(smoke("evaluate"),
                                          [f"methods.0.gamma=!!python/object/apply:os.system "
                                           f"['touch {marker}']"])
    assert not marker.exists()
