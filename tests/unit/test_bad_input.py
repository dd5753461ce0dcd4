"""Bad input gives a clear error naming the field, from the API and from the CLI."""

import subprocess
import sys

import pytest

from speclab.api import Decoder
from speclab.cli import main
from speclab.models.loading import ModelLoadError


@pytest.fixture(scope="module")
def dec(tiny_pair):
    return Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"prompt_ids": []}, "prompt"),
        ({"prompt_ids": [1], "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt_ids": [1], "max_new_tokens": -3}, "max_new_tokens"),
        ({"prompt_ids": [1], "method": "chain", "gamma": 0}, "gamma"),
        ({"prompt_ids": [1], "method": "salf", "salf_threshold": 1.5}, "salf_threshold"),
        ({"prompt_ids": [1], "method": "salf", "salf_threshold": 0.0}, "salf_threshold"),
        ({"prompt_ids": [1], "method": "nope"}, "method"),
        ({"prompt_ids": [1], "verify": "nope"}, "verify"),
        ({"prompt_ids": [1], "temperature": -1.0}, "temperature"),
        ({"prompt_ids": [1], "top_p": 0.0}, "top_p"),
        ({"prompt_ids": [10_000]}, "prompt_ids"),
        ({"prompt": ""}, "prompt"),
    ],
)
def test_api_errors_name_the_field(dec, kwargs, field):
    with pytest.raises(ValueError, match=field):
        dec.generate(**kwargs)


def test_vocab_mismatch_names_both_sizes(tiny_pair, tmp_path):
    from speclab.models.tiny import build_tiny_llama

    other = build_tiny_llama(tmp_path / "v100", vocab_size=100, num_layers=1)
    with pytest.raises(ModelLoadError, match="target vocab_size=64.*draft vocab_size=100"):
        Decoder.from_pretrained(tiny_pair["target"], str(other))


def test_missing_model_dir(tmp_path):
    with pytest.raises(ModelLoadError, match="target: model directory"):
        Decoder.from_pretrained(str(tmp_path / "nowhere"))


@pytest.mark.parametrize(
    "extra,field",
    [
        (["--prompt-ids", "1,2", "--max-new-tokens", "0"], "max_new_tokens"),
        (["--prompt-ids", "1,2", "--gamma", "0"], "gamma"),
        (["--prompt-ids", "1,2", "--method", "salf", "--salf-threshold", "1.2"], "salf_threshold"),
        (["--prompt-ids", ""], "prompt_ids"),
        (["--prompt", ""], "prompt"),
        (["--prompt-ids", "a,b"], "prompt_ids"),
        (["--prompt-ids", "1,2", "--prompt-ids", "1,900"], "prompt_ids"),
        (["--prompt-ids", "1,2", "--prompt-ids", "3", "--batch-size", "0"], "batch_size"),
    ],
)
def test_cli_errors_exit_nonzero(tiny_pair, capsys, extra, field):
    argv = ["generate", "--target", tiny_pair["target"], "--draft", tiny_pair["close"], *extra]
    assert main(argv) == 2
    assert field in capsys.readouterr().err


def test_cli_missing_dir_and_vocab_mismatch(tiny_pair, tmp_path, capsys):
    assert main(["generate", "--target", str(tmp_path / "x"), "--method", "ar",
                 "--prompt-ids", "1"]) == 2
    assert "target: model directory" in capsys.readouterr().err


def test_cli_json_output_through_the_installed_command(tiny_pair):
    cmd = [sys.executable, "-m", "speclab.cli", "generate", "--target", tiny_pair["target"],
           "--draft", tiny_pair["close"], "--method", "salf", "--prompt-ids", "1,2,3",
           "--max-new-tokens", "12", "--num-samples", "2", "--temperature", "1", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    import json

    rows = [json.loads(line) for line in out.strip().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert len(row["token_ids"]) == 12
        assert set(row["stats"]) >= {"new_tokens", "target_calls", "draft_calls", "tau",
                                     "acceptance_rate", "discard_rate", "verification_rate",
                                     "wall_s", "draft_s", "verify_s"}


def _speclab(*args: str) -> subprocess.CompletedProcess:
    """The installed command line, as a user types it (no Ray is started by these)."""
    from speclab.paths import repo_root

    return subprocess.run([sys.executable, "-m", "speclab.cli", *args], cwd=repo_root(),
                          capture_output=True, text=True, timeout=300)


def test_overrides_after_the_options_and_one_line_errors_with_status_2():
    """The README's form (overrides after --config / --address) is parsed; an unreachable
    job server and a busy port are each one line naming the problem, exit status 2."""
    import socket

    smoke = "experiments/smoke/evaluate.yaml"
    bad = _speclab("submit", "evaluate", "--config", smoke, "--address", "127.0.0.1:1",
                   "data.num_prompts=zero")
    assert bad.returncode == 2 and "data.num_prompts" in bad.stderr, bad.stderr[-2000:]
    gone = _speclab("submit", "evaluate", "--config", smoke, "--address", "127.0.0.1:1",
                    "data.num_prompts=2")
    assert gone.returncode == 2, gone.stderr[-2000:]
    assert gone.stderr.strip().splitlines() == [
        "error: address: no Ray job server answers at http://127.0.0.1:1 (Failed to connect "
        "to Ray at address: http://127.0.0.1:1.)"], gone.stderr[-2000:]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ui = _speclab("ui", "--port", str(port))
    assert ui.returncode == 2 and ui.stdout == "", (ui.stdout, ui.stderr)
    assert ui.stderr.strip() == f"error: port: cannot listen on 127.0.0.1:{port} (already in use)"
    unknown = _speclab("run", "evaluate", "--config", smoke, "--bogus")
    assert unknown.returncode == 2 and "unrecognized arguments: --bogus" in unknown.stderr


def test_widen_and_bench_drafter_options_are_checked_first(tmp_path, capsys):
    """``speclab reference --widen`` (alias ``--widen-eagle``) needs ``--out`` and
    ``--large``; ``speclab bench --eagle`` / ``--medusa`` refuse a folder that holds no
    such drafter before any model is built or loaded (the batched bench too), and
    ``--medusa`` does not go with ``--batch-sizes``; the bench labels a drafter's row by
    its folder (and EAGLE version)."""
    from speclab.bench import EAGLE_RUN, MEDUSA_RUN, eagle_run, medusa_run

    assert main(["reference", "--large", "--widen", str(tmp_path)]) == 2
    assert "--widen and --out" in capsys.readouterr().err
    assert main(["reference", "--widen-eagle", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "--widen: only with --large" in capsys.readouterr().err
    assert main(["bench", "--eagle", str(tmp_path / "missing")]) == 2
    assert "--eagle:" in capsys.readouterr().err
    assert main(["bench", "--eagle", str(tmp_path / "missing"), "--batch-sizes", "4"]) == 2
    assert "--eagle: " in capsys.readouterr().err  # the batched bench refuses it first too
    assert main(["bench", "--medusa", str(tmp_path), "--batch-sizes", "4"]) == 2
    assert "--medusa: not with --batch-sizes" in capsys.readouterr().err
    (tmp_path / "e3").mkdir()
    (tmp_path / "e3" / "config.json").write_text('{"kind": "speclab-eagle", "version": 3}')
    run = eagle_run(str(tmp_path / "e3"))
    assert run.name.startswith("eagle3 e3 ") and run.method == "eagle"
    assert run.params == {**EAGLE_RUN, "eagle_model": str(tmp_path / "e3")}
    # a real pair's registered drafters download to folders of one name: labelled by it
    named = eagle_run(str(tmp_path / "e3"), "models:/speclab-eagle3-smollm2/1")
    assert named.name.startswith("eagle3 models:/speclab-eagle3-smollm2/1 ")
    assert main(["bench", "--medusa", str(tmp_path / "e3")]) == 2  # an EAGLE folder
    assert "--medusa:" in capsys.readouterr().err
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"kind": "speclab-medusa"}')
    assert main(["bench", "--medusa", str(tmp_path / "m")]) == 2  # no calibration
    assert "tree.json" in capsys.readouterr().err
    (tmp_path / "m" / "tree.json").write_text("{}")
    run = medusa_run(str(tmp_path / "m"))
    assert run.name.startswith("medusa m ") and run.method == "medusa"
    assert run.params == {**MEDUSA_RUN, "medusa_model": str(tmp_path / "m")}
