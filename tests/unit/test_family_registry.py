"""The family catalogue (no Ray): built-ins listed, unknown names refused with the known
ones, and a whole family from a plugin module (:mod:`tests.plugins.mlp_speculator`)
registering its family, objectives, task and method, validating in a ``train_drafter``
config (its method's artifact field defaulting to ``trained``), refusing bad knobs by
``drafter.<knob>``, and decoding losslessly with an artifact checked against its target."""

from __future__ import annotations

import pytest

from speclab.config import ConfigError
from speclab.config.jobs import TrainDrafterJob, TuneJob
from speclab.families.registry import BUILTIN, families, family, sweep_kinds

PLUGIN = "tests.plugins.mlp_speculator"


@pytest.fixture(scope="module")
def plugin():
    """The plugin module, imported (what ``$SPECLAB_PLUGINS`` does in every process)."""
    import importlib

    return importlib.import_module(PLUGIN)


def _job(**extra) -> dict:
    return {"job": "train_drafter", "family": "mlp_speculator",
            "distill": {"seq_len": 16}, **extra}


def test_builtin_families_are_listed():
    names = {ref.split(":")[0].rsplit(".", 1)[-1] for ref in BUILTIN}
    assert names == {"eagle", "medusa", "specdecpp", "atspeed"}
    known = families()
    assert names <= set(known)
    for name in names:  # each declaration is complete enough to be looked up by name
        fam = family(name)
        assert fam.name == name and fam.task and fam.train_group and fam.train_config
    assert {"eagle", "train_head", "atspeed"} <= set(sweep_kinds())


def test_unknown_family_names_the_field_and_the_known_ones():
    with pytest.raises(ValueError) as err:
        family("nope")
    msg = str(err.value)
    assert msg.startswith("family: unknown drafter family 'nope'")
    for name in ("atspeed", "eagle", "medusa", "specdecpp"):
        assert name in msg
    with pytest.raises(ValueError, match=r"^drafter\.family: unknown"):
        family("nope", field="drafter.family")
    with pytest.raises(ConfigError, match="family"):
        TrainDrafterJob.from_dict({"job": "train_drafter", "family": "nope"})


def test_importing_the_plugin_registers_family_objectives_task_and_method(plugin):
    from speclab.config.method import methods
    from speclab.families.objectives import objectives
    from speclab.train.tasks import TASKS, parse_task_config, task_class

    fam = family("mlp_speculator")
    assert fam is plugin.FAMILY and fam.method == "mlp_speculator"
    assert fam.artifact_field == "mlp_model" and fam.train_group == "drafter"
    assert fam.train_config_class() is plugin.MlpTrainConfig
    assert sweep_kinds()["mlp_speculator"] is fam
    objs = objectives("mlp_speculator")
    assert set(objs) == {"mlp_ce", "mlp_kd"} == set(fam.objectives)
    assert all(o.kind_for(plugin.MlpTrainConfig()) == "feat" for o in objs.values())
    assert "mlp_speculator" in TASKS and task_class("mlp_speculator") is plugin.MlpTask
    task = parse_task_config({"kind": "mlp_speculator", "target": "/t",
                              "drafter": {"depth": 2}})
    assert isinstance(task, plugin.MlpTaskConfig) and task.drafter.depth == 2
    cls = methods()["mlp_speculator"]
    assert cls is plugin.MlpSpeculatorConfig
    assert cls.needs_features and not cls.needs_draft_model
    assert fam.call("data_kinds", plugin.MlpTrainConfig(loss="mlp_kd")) == {"feat"}


def test_train_drafter_config_validates_and_defaults_the_artifact_to_trained(plugin):
    cfg = TrainDrafterJob.from_dict(_job(
        drafter={"depth": 2, "loss": "mlp_kd"},
        method={"name": "mlp_speculator"},
        methods=[{"name": "mlp_speculator", "depth": 1}, {"name": "chain", "gamma": 2},
                 {"name": "mlp_speculator", "mlp_model": "/elsewhere"}]))
    assert cfg.family == "mlp_speculator"
    group = cfg.drafter_config()
    assert isinstance(group, plugin.MlpTrainConfig)
    assert (group.depth, group.loss, group.hidden) == (2, "mlp_kd", 0)
    assert cfg.method.mlp_model == "trained"
    assert [getattr(m, "mlp_model", None) for m in cfg.methods] == [
        "trained", None, "/elsewhere"]  # a given artifact is kept
    assert cfg.objectives() == [("mlp_kd", group)]
    # methods: [] evaluates the trained artifact, not the default chain (needs a draft)
    bare = TrainDrafterJob.from_dict(_job(drafter={"depth": 2}, methods=[]))
    assert [m.name for m in bare.method_list()] == ["mlp_speculator"]
    assert bare.method.mlp_model == "trained"


@pytest.mark.parametrize("drafter,message", [
    ({"depth": 0}, "drafter.depth: Input should be greater than or equal to 1"),
    ({"hidden": -1}, "drafter.hidden"),
    ({"stage_decay": 2}, "drafter.stage_decay"),
    ({"nope": 1}, "drafter.nope: Extra inputs are not permitted"),
    ({"loss": "hass"}, "drafter.loss: unknown objective: unknown mlp_speculator objective "
                       "'hass'; known: mlp_ce, mlp_kd"),
    ({"depth": 16}, "drafter.depth (16) must be below distill.seq_len (16)"),
])
def test_bad_drafter_knobs_name_the_field(plugin, drafter, message):
    with pytest.raises(ConfigError) as err:
        TrainDrafterJob.from_dict(_job(drafter=drafter, methods=[{"name": "mlp_speculator"}]))
    assert message in str(err.value)


def test_tune_config_of_the_plugin_sweep_kind(plugin):
    data = {"job": "tune", "drafter": {"depth": 2}, "method": {"name": "mlp_speculator"},
            "sweep": {"kind": "mlp_speculator", "space": {"drafter.depth": {"grid": [1, 2]}}}}
    cfg = TuneJob.from_dict(data)
    assert cfg.drafter["depth"] == 2 and cfg.method.mlp_model == "trained"
    with pytest.raises(ConfigError, match="method.name: a mlp_speculator sweep evaluates"):
        TuneJob.from_dict({**data, "method": {"name": "chain"}})
    with pytest.raises(ConfigError, match=r"drafter\.nope"):
        TuneJob.from_dict({**data, "drafter": {"nope": 1}})
    with pytest.raises(ConfigError, match="drafter"):  # a decode sweep has no drafter group
        TuneJob.from_dict({"job": "tune", "drafter": {"depth": 2},
                           "sweep": {"kind": "decode", "space": {"method.gamma": {
                               "grid": [1, 2]}}}})


def test_artifact_decodes_losslessly_and_is_checked_against_the_target(plugin, tiny_pair,
                                                                       tmp_path):
    """An (untrained) speculator saved and loaded: its chains verify to AR's output at
    T=0, it drafts; a speculator for another vocabulary is refused naming mlp_model."""
    import torch
    from transformers import AutoConfig

    from speclab.api import Decoder

    target = tiny_pair["target"]
    config = AutoConfig.from_pretrained(target)
    torch.manual_seed(0)
    model = plugin.MlpSpeculator(plugin.MlpMeta.for_target(config, target, 16, 3))
    folder = plugin.save_mlp(model, tmp_path / "mlp")
    loaded = plugin.load_mlp(folder)
    assert loaded.meta == model.meta and fam_check(plugin, loaded)
    ids = model(torch.randn(2, 7, config.hidden_size), torch.randint(0, 64, (2, 8)))
    assert [tuple(x.shape) for x in ids] == [(2, 6, 64), (2, 5, 64), (2, 4, 64)]
    dec = Decoder.from_pretrained(target)
    ar = dec.generate(prompt_ids=[1, 2, 3, 4], method="ar", max_new_tokens=16)
    got = dec.generate(prompt_ids=[1, 2, 3, 4], method="mlp_speculator", mlp_model=str(folder),
                       max_new_tokens=16)
    assert got.token_ids == ar.token_ids and got.stats.drafted_tokens > 0
    other = plugin.MlpSpeculator(plugin.MlpMeta(target, "LlamaForCausalLM", 99,
                                                config.hidden_size, 16, 2))
    with pytest.raises(ValueError, match="mlp_model: an MLP speculator trained for a target "
                                         "with vocab_size=99, but the target has 64"):
        family("mlp_speculator").call("check_artifact", other, config, "mlp_model", target)
    with pytest.raises(ValueError, match="vocab_size=99, but the target has 64"):
        # as Serve's draft replica calls it without the target's folder: the vocabulary
        family("mlp_speculator").call("check_artifact", other, None, "mlp_model", None, 64)
    family("mlp_speculator").call("check_artifact", loaded, None, "mlp_model", None, 64)
    with pytest.raises(ValueError, match="mlp_model: an MLP speculator trained for a target "
                                         "with vocab_size=99"):
        dec.generate(prompt_ids=[1, 2, 3], method="mlp_speculator", mlp_model=other,
                     max_new_tokens=4)
    with pytest.raises(ValueError, match="mlp_model: .* holds no MLP speculator"):
        plugin.load_mlp(tmp_path)


def fam_check(plugin, model) -> bool:
    """The family's ``is_artifact`` hook, looked up by name."""
    return family("mlp_speculator").call("is_artifact", model) and not family(
        "mlp_speculator").call("is_artifact", object())
