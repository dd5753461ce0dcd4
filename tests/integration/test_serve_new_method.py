"""Pieces registered outside speclab reach every surface, the Serve app included (ONE app
start for the module):

* a METHOD registered by a test file alone (``repeat``, tests/unit/test_method_registry.py):
  ``$SPECLAB_METHODS`` names the module, the draft deployment imports it, and the served
  output equals the offline engine's (greedy: AR's);
* a verification RULE registered by a plugin module that THIS file writes into a temporary
  folder (``constant``: accepts no draft token and commits its ``token`` parameter every
  round, so its effect shows in every output): ``$SPECLAB_PLUGINS`` names the module, and
  YAML configs, ``speclab generate --verify`` and every decoding route of the Serve app
  (``verify`` / ``verify_params``, listed in ``/openapi.json``) accept it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import requests

from serve_apps.loadtest import PROMPTS
from tests.integration.conftest import ROOT
from tests.integration.test_serve import _start, _stop, tiny  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration

PLUGIN = "speclab_toy_rule_plugin"
PLUGIN_SOURCE = '''
"""A toy verification rule registered outside speclab (written by a test)."""
from pydantic import Field

from speclab.config.base import StrictModel
from speclab.decoding.rules import Rule, Verdict, register_rule


class ConstantParams(StrictModel):
    token: int = Field(7, ge=0, description="the token committed every round")


def verify_constant(tree, target_logits, sampling, generator, params):
    """Accept no draft token; commit ``params.token`` instead of the target's token."""
    return Verdict([0], params.token, 1 if tree.children[0] else 0)


register_rule(Rule("constant", verify_constant, ConstantParams, relaxed=True,
                   doc="toy: commits `token` every round; relaxed"))
'''
TOKEN = 11  # the toy rule's parameter in the requests below (default 7)


def _plugin_env(folder) -> dict[str, str]:
    """The environment that makes every process import the toy rule's module."""
    (folder / f"{PLUGIN}.py").write_text(textwrap.dedent(PLUGIN_SOURCE))
    path = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    return {"SPECLAB_PLUGINS": PLUGIN, "PYTHONPATH": path}


@pytest.fixture(scope="module")
def app(tmp_path_factory, tiny):  # noqa: F811
    """``method: repeat`` on the tiny target, started with both plugin variables set."""
    root = tmp_path_factory.mktemp("serve_plugins")
    target, _ = tiny
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECLAB_METHODS", "tests.unit.test_method_registry")
        for key, value in _plugin_env(root).items():
            mp.setenv(key, value)
        proc, url = _start(root, [f"models.target={target}", "method={name: repeat, span: 3}"])
    yield url
    _stop(proc)


def test_method_registered_in_a_test_file_runs_through_serve(app, tiny):  # noqa: F811
    import tests.unit.test_method_registry  # noqa: F401  (registers `repeat` here too)
    from speclab.api import Decoder

    target, _ = tiny
    dec = Decoder.from_pretrained(target)
    want = dec.generate(PROMPTS[0], method="repeat", span=3, max_new_tokens=24)
    assert want.token_ids == dec.generate(PROMPTS[0], method="ar", max_new_tokens=24).token_ids
    r = requests.post(app + "/generate", json={"prompt": PROMPTS[0], "max_tokens": 24})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["method"] == "repeat" and body["token_ids"] == want.token_ids
    assert body["stats"]["accepted_lengths"] == want.stats.accepted_lengths
    assert body["stats"]["drafted_tokens"] == want.stats.drafted_tokens > 0
    assert body["stats"]["draft_s"] > 0 and body["stats"]["verify_s"] > 0


def test_rule_registered_by_a_plugin_module_works_in_yaml_and_the_cli(tmp_path, tiny):  # noqa: F811
    target, _ = tiny
    env = {**os.environ, **_plugin_env(tmp_path)}
    (tmp_path / "x.yaml").write_text("job: evaluate\ndecoding: {verify: constant, "
                                     f"verify_params: {{token: {TOKEN}}}}}\n")
    check = textwrap.dedent(f"""
        from speclab.config import ConfigError, load_experiment
        cfg = load_experiment({str(tmp_path / 'x.yaml')!r})
        print(cfg.decoding.verify, cfg.decoding.verify_params)
        try:
            load_experiment({str(tmp_path / 'x.yaml')!r}, ["decoding.verify_params.token=-1"])
        except ConfigError as err:
            print("refused:", err)
        """)
    res = subprocess.run([sys.executable, "-c", check], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"constant {{'token': {TOKEN}}}" in res.stdout
    assert "refused: decoding: verify_params (constant): token: Input should be greater than " \
           "or equal to 0" in res.stdout, res.stdout
    cli = [sys.executable, "-m", "speclab.cli", "generate", "--target", target, "--method",
           "ar", "--prompt-ids", "1,2,3", "--max-new-tokens", "5"]
    helptext = subprocess.run([*cli[:4], "--help"], cwd=ROOT, env=env, capture_output=True,
                              text=True).stdout
    assert "constant (toy: commits `token` every round; relaxed; token=7)" in \
        " ".join(helptext.split())
    out = subprocess.run([*cli, "--verify", "constant", "--verify-param", f"token={TOKEN}",
                          "--json"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["token_ids"] == [TOKEN] * 5 and got["stats"]["tau"] == 1.0
    bad = subprocess.run([*cli, "--verify", "constant", "--verify-param", "token=-2"],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "verify_params (constant): token" in bad.stderr, bad.stderr
    unknown = subprocess.run([*cli, "--verify", "constant"], cwd=ROOT, capture_output=True,
                             text=True)  # without the plugin: not a rule
    assert unknown.returncode == 2 and "verify: must be one of" in unknown.stderr


def test_rule_registered_by_a_plugin_module_runs_on_every_decoding_route(app):
    rule = {"verify": "constant", "verify_params": {"token": TOKEN}}
    r = requests.post(app + "/generate", json={"prompt_ids": [1, 2, 3], "max_tokens": 6,
                                               **rule})
    assert r.status_code == 200, r.text
    stats = r.json()["stats"]
    assert r.json()["token_ids"] == [TOKEN] * 6  # the rule ran on the target replica
    # every round commits the rule's one token, none of the drafted ones
    assert stats["accepted_lengths"] == [1] * 6 and stats["drafted_tokens"] > 0
    assert stats["tau"] == 1.0
    assert requests.post(app + "/generate", json={
        "prompt_ids": [1, 2, 3], "max_tokens": 3, "verify": "constant"}).json()[
        "token_ids"] == [7] * 3  # the parameter's default
    for path, body in (("/v1/completions", {"prompt": PROMPTS[0]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": PROMPTS[0]}]})):
        r = requests.post(app + path, json={**body, "max_tokens": 6, "temperature": 0, **rule})
        assert r.status_code == 200, (path, r.text)
        assert r.json()["usage"]["completion_tokens"] == 6
        assert r.json()["speclab"]["accepted_lengths"] == [1] * 6, path
        # vLLM's per-request SD statistics at the default level (summary): none accepted
        m = r.json()["metrics"]["speculative_decoding"]
        assert m["num_accepted_draft_tokens"] == 0 and m["num_draft_tokens"] > 0, m
        assert m["acceptance_histogram"][0] == m["num_spec_steps"] >= 1, m
        assert m["mean_acceptance_length"] == 1.0 and "per_step_accepted" not in m
        # bad parameters and unknown rules: 400 naming the field, in OpenAI's shape
        bad = requests.post(app + path, json={**body, "verify": "constant",
                                              "verify_params": {"token": -1}})
        err = bad.json()["error"]
        assert bad.status_code == 400 and err["param"] == "verify_params", bad.text
        assert "verify_params (constant): token" in err["message"]
        bad = requests.post(app + path, json={**body, "verify": "nope"})
        err = bad.json()["error"]
        assert bad.status_code == 400 and err["param"] == "verify", bad.text
        assert "'constant'" in err["message"]  # the registered names, the plugin's too
    spec = requests.get(app + "/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for model in ("GenerateRequest", "CompletionRequest", "ChatCompletionRequest"):
        prop = schemas[model]["properties"]
        names = next(o["enum"] for o in prop["verify"]["anyOf"] if o.get("type") == "string")
        assert {"greedy", "sample", "typical", "constant"} <= set(names), model
        assert "token (integer, >= 0, default 7)" in prop["verify_params"]["description"]
        assert {"$ref": "#/components/schemas/VerifyParams.constant"} in \
            prop["verify_params"]["anyOf"]
    assert schemas["VerifyParams.constant"]["properties"]["token"]["minimum"] == 0
