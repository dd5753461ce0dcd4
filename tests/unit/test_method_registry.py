"""A new decoding method is one module plus one registration: this file alone defines
the ``repeat`` method (a drafter that proposes copies of the last committed token) and
registers it. It then appears in ``speclab generate --help``, validates in YAML, and
runs offline (here) and through Serve (tests/integration/test_serve_new_method.py, which
names this module in ``$SPECLAB_METHODS``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field

from speclab.config.method import MethodSpec, register
from speclab.decoding.tree import DETERMINISTIC, TokenTree
from speclab.drafters.base import Drafter

ROOT = Path(__file__).resolve().parents[2]
MODULE = "tests.unit.test_method_registry"


class RepeatDrafter(Drafter):
    """Proposes ``span`` copies of the root token as a chain (no draft model)."""

    name = "repeat"

    def __init__(self, span: int) -> None:
        self.span = span

    def reset(self) -> None:
        """Stateless."""

    def propose(self, committed: list[int], budget: int) -> TokenTree:
        tree, node = TokenTree(committed[-1]), 0
        for _ in range(min(self.span, budget)):
            tree.set_children_kind(node, DETERMINISTIC)
            node = tree.add(committed[-1], node)
        return tree

    def accept(self, tree: TokenTree, path: list[int]) -> None:
        """Nothing to keep."""


@register
class RepeatConfig(MethodSpec):
    """``repeat``: a toy method registered by a test file alone."""

    name: Literal["repeat"] = "repeat"
    needs_draft_model = False
    span: int = Field(3, gt=0, le=16, description="repeat: copies of the last token proposed")

    def build(self, ctx) -> RepeatDrafter:
        return RepeatDrafter(self.span)


def test_new_method_appears_in_generate_help():
    env = {**os.environ, "SPECLAB_METHODS": MODULE}
    out = subprocess.run([sys.executable, "-m", "speclab.cli", "generate", "--help"],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    assert "repeat" in out.split("--method")[1].split("\n")[0]  # a --method choice
    assert "--span" in out and "copies of the last token" in out


def test_new_method_validates_in_yaml(tmp_path):
    from speclab.config import ConfigError, load_experiment

    path = tmp_path / "x.yaml"
    path.write_text("job: evaluate\nmethod: {name: repeat, span: 5}\n")
    cfg = load_experiment(path)
    assert cfg.method.name == "repeat" and cfg.method.params() == {"span": 5}
    assert not cfg.method.needs_draft_model
    with pytest.raises(ConfigError, match="method.span: Input should be less than or equal"):
        load_experiment(path, ["method.span=99"])
    with pytest.raises(ConfigError, match="method.gamma: Extra inputs"):
        load_experiment(path, ["method.gamma=2"])


def test_new_method_runs_offline_and_through_the_cli(tiny_pair):
    from speclab.api import Decoder

    dec = Decoder.from_pretrained(tiny_pair["target"])
    for prompt in ([1, 2, 3], [7, 7, 7, 7], [5]):
        want = dec.generate(prompt_ids=prompt, method="ar", max_new_tokens=20).token_ids
        res = dec.generate(prompt_ids=prompt, method="repeat", span=4, max_new_tokens=20)
        assert res.token_ids == want  # greedy verification keeps it lossless
        assert res.stats.drafted_tokens > 0
    env = {**os.environ, "SPECLAB_METHODS": MODULE}
    cli = subprocess.run([sys.executable, "-m", "speclab.cli", "generate", "--target",
                          tiny_pair["target"], "--method", "repeat", "--span", "2",
                          "--prompt-ids", "1,2,3", "--max-new-tokens", "20", "--json"],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr[-2000:]
    ar = dec.generate(prompt_ids=[1, 2, 3], method="ar", max_new_tokens=20).token_ids
    assert json.loads(cli.stdout)["token_ids"] == ar
    other = subprocess.run([sys.executable, "-m", "speclab.cli", "generate", "--target",
                          tiny_pair["target"], "--method", "repeat", "--gamma", "2",
                          "--prompt-ids", "1,2"], cwd=ROOT, env=env, capture_output=True,
                         text=True)
    assert other.returncode == 2, other.stderr[-2000:]  # refused, as a config refuses it
    assert "gamma: not a knob of method 'repeat'" in other.stderr
    assert len(other.stderr.strip().splitlines()) == 1, other.stderr  # one line
    bad = subprocess.run([sys.executable, "-m", "speclab.cli", "generate", "--target",
                          tiny_pair["target"], "--method", "repeat", "--span", "0",
                          "--prompt-ids", "1,2"], cwd=ROOT, env=env, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "span: Input should be greater than 0" in bad.stderr
