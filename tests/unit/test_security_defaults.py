"""Security defaults, each through the path a user takes: servers on the loopback unless
told otherwise (the listening sockets themselves are checked in the Serve and UI
integration tests), no code shipped with a model ever runs, ``models:/`` names cannot
reach other directories, and a downloaded artifact stays inside its folder. YAML is
safe-loaded: tests/unit/test_fuzz_inputs.py::test_yaml_tags_are_refused_not_run."""

from __future__ import annotations

import ast
import contextlib
import io
import json
from pathlib import Path

import pytest

from speclab.models.loading import ModelLoadError, check_registry_uri

ROOT = Path(__file__).resolve().parents[2]


def cli(argv: list[str]) -> tuple[int, str]:
    from speclab import cli as speclab_cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = speclab_cli.main(argv)
    return rc, err.getvalue()


def test_servers_default_to_the_loopback():
    from speclab.config.schema import ServeConfig

    assert ServeConfig().host == "127.0.0.1"
    with pytest.raises(ValueError, match="api_key: required"):
        ServeConfig(host="0.0.0.0")  # another interface only with an API key


@pytest.fixture
def custom_code_model(tmp_path) -> tuple[Path, Path]:
    """A saved model whose config asks for its own Python code (``auto_map``) under a model
    type transformers does not know; importing that code would create ``marker``."""
    from speclab.models.tiny import build_tiny_llama

    folder = build_tiny_llama(tmp_path / "custom", seed=1, vocab_size=64, num_layers=1)
    marker = tmp_path / "code-ran"
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="speclab-custom-test",
               auto_map={"AutoConfig": "custom.Cfg", "AutoModelForCausalLM": "custom.Model"})
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "custom.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    return folder, marker


def test_code_shipped_with_a_model_never_runs(custom_code_model):
    folder, marker = custom_code_model
    rc, err = cli(["generate", "--target", str(folder), "--method", "ar",
                   "--prompt-ids", "1,2", "--max-new-tokens", "2"])
    assert rc == 2 and "target:" in err and "trust_remote_code is always off" in err, err
    assert not marker.exists()


def test_every_transformers_load_turns_remote_code_off_explicitly():
    """Every ``Auto*.from_pretrained`` call in the product passes trust_remote_code=False
    (transformers' default may prompt on a terminal, or run code for unknown types)."""
    missing = []
    for path in [*(ROOT / "platform").rglob("*.py"), *(ROOT / "serve_apps").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "from_pretrained"
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id.startswith("Auto")):
                flag = [k for k in node.keywords if k.arg == "trust_remote_code"]
                if not flag or not (isinstance(flag[0].value, ast.Constant)
                                    and flag[0].value.value is False):
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not missing, missing


@pytest.mark.parametrize("uri", [
    "models:/../../etc/1", "models:/a/../b", "models:/a/..", "models://etc/passwd",
    "models:/.hidden/1", "models:/a/1/extra", "runs:/../x",
    "runs:/0123456789abcdef0123456789abcdef/../x", "models:/a/1%2f..%2f..",
])
def test_registry_names_cannot_reach_other_directories(uri):
    with pytest.raises(ModelLoadError, match="is not a model URI"):
        check_registry_uri(uri, "target")
    rc, err = cli(["generate", "--target", uri, "--method", "ar", "--prompt-ids", "1"])
    assert rc == 2 and f"target: {uri!r} is not a model URI" in err, err


@pytest.mark.parametrize("uri", ["models:/speclab-smoke-recommender/1", "models:/a b/latest",
                                 "models:/drafter@champion",
                                 "runs:/0123456789abcdef0123456789abcdef/model"])
def test_well_formed_registry_uris_pass(uri):
    assert check_registry_uri(uri) == uri


def test_a_downloaded_artifact_stays_inside_its_folder(tmp_path, monkeypatch, tiny_pair):
    """A real registry round trip lands in its own download folder; a symlink that leads
    out of the folder is refused (and the folder removed)."""
    import mlflow

    from speclab.tracking import check_inside, log_hf_model, resolve_model_uri

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("SPECLAB_HOME", str(tmp_path / "home"))
    mlflow.set_tracking_uri(uri)
    exp = mlflow.create_experiment("sec", artifact_location=str(tmp_path / "artifacts"))
    with mlflow.start_run(experiment_id=exp):
        model_uri = log_hf_model(tiny_pair["weak"], "sec-weak")
    local = Path(resolve_model_uri(model_uri, uri))
    assert (local / "config.json").exists()
    folder = next(p for p in local.resolve().parents if p.name.startswith("speclab-model-"))
    check_inside(folder, local)

    outside = tmp_path / "outside"
    outside.mkdir()
    (local / "escape").symlink_to(outside)
    with pytest.raises(ValueError, match="outside the download folder"):
        check_inside(folder, local)
    mlflow.set_tracking_uri(None)


def test_a_models_uri_is_downloaded_once_per_process_and_removed_at_exit(tmp_path):
    """Each ``models:/`` lookup once left a folder in /tmp: now one download per store
    and URI in a process, removed when the process exits."""
    import mlflow

    from speclab import tracking_store

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("dl")
    from speclab.tracking import log_hf_model

    with mlflow.start_run():
        assert log_hf_model(folder, "tiny") == "models:/tiny/1"
    first = tracking_store.resolve_model_uri("models:/tiny/1", uri)
    again = tracking_store.resolve_model_uri("models:/tiny/1", uri)
    assert first == again and (Path(first) / "config.json").exists()
    made = [f for f in tracking_store._FOLDERS if Path(first).is_relative_to(f)]
    assert len(made) == 1
    tracking_store._remove_downloads()  # what the process's exit runs
    assert not made[0].exists()
    third = tracking_store.resolve_model_uri("models:/tiny/1", uri)  # gone: fetched anew
    assert (Path(third) / "config.json").exists()
    tracking_store._remove_downloads()
