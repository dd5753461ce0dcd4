"""Strict configs: unknown keys rejected, errors name the dotted field, overrides apply."""

import pytest

from speclab.config import ConfigError, ExperimentConfig


def test_defaults_and_override_precedence(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("method: {name: chain, gamma: 3}\ndecoding: {max_new_tokens: 10}\n")
    cfg = ExperimentConfig.from_yaml(path, ["method.gamma=7", "data.num_prompts=2"])
    assert cfg.method.gamma == 7  # flag > yaml
    assert cfg.decoding.max_new_tokens == 10  # yaml > default
    assert cfg.data.num_prompts == 2
    assert cfg.method_list() == [cfg.method]
    assert cfg.method.params() == {"gamma": 7}


@pytest.mark.parametrize(
    "data,overrides,message",
    [
        ({"method": {"gamma": 0}}, [], "method.gamma: Input should be greater than 0"),
        ({"bogus": 1}, [], "bogus: Extra inputs are not permitted"),
        ({"method": {"name": "salf", "threshold": 1.0}}, [], "method.threshold"),
        ({}, ["methods=[{name: chain}]", "methods.0.gamma=-1"], "methods.0.gamma"),
        ({}, ["decoding.top_p=0"], "decoding.top_p"),
        ({}, ["models.device=tpu"], "models.device"),
        ({}, ["method.name=salf", "method.batch=40", "method.nodes=8"], "batch (40)"),
        ({}, ["noequals"], "expected key=value"),
        ({}, ["data.prompts=jsonl"], "path is required"),
    ],
)
def test_errors_name_the_field(data, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ExperimentConfig.from_dict(data, overrides)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        ExperimentConfig.from_yaml(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        ExperimentConfig.from_yaml(bad)
