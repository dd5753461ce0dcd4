"""Exports checked by the reading code of the runtimes that serve them (issue 57).

Tiny drafters (an EAGLE-3 drafter with a reduced and one with the full vocabulary, the
EAGLE-3 variants speculators carries: ``norm_before_residual``, ``norm_before_fc``,
EAGLE-3.1's ``fc_norm`` + ``norm_output`` (the normed state fed back), ``attention_bias``
and all of them at once (``norm_before_fc`` and ``fc_norm`` exclude each other), one with
``target_hidden_size`` other than its width, an EAGLE-1/2 drafter in the layout
``eagle.norms: false`` trains, one and two layers) are exported with ``speclab export``;
then

- every ``--format speculators`` folder is read by speculators' OWN code (the pinned
  package of tests/interop/requirements.txt, installed by ``make setup`` into
  ``.venv/interop``), all of them in one subprocess (tests/interop/run_speculators.py):
  its config class parses the config, its model class loads the weights with no
  unexpected key and no missing one but the two it never saves (the verifier's LM head
  and final norm, which it takes from the verifier for its training loss), and its
  forward (one step, and its 3-step training-time test) computes what speclab's drafter
  computes on the same inputs, the state it feeds back included (the normed one under
  ``norm_output``, as its own TTT loop does);
- every ``--format eagle`` folder holds exactly the keys and shapes the EAGLE authors'
  code builds from its config.json (tests/interop/eagle_layout.py, written from
  SafeAILab/EAGLE's cnets.py / cnets1.py / ea_model.py), beyond what its loader fills in
  or deletes itself;
- an EAGLE-1/2 drafter is refused for ``--format speculators`` (speculators 0.9 has no
  EAGLE-1/2 model), the message naming ``--format eagle``; so is a ``target_hidden_size``
  drafter (speculators 0.9.0 sizes fc by hidden_size), which ``--format eagle`` takes
  (cnets.py reads target_hidden_size); every other variant is refused for ``--format
  eagle``, attention biases included (cnets.py builds the EAGLE-3 attention with
  ``bias=False``).

Without ``.venv/interop`` the speculators checks skip, except under CI (the env var CI
set), where they fail: CI installs it, so they can never pass there unrun.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from speclab.cli import main
from speclab.families.eagle.model import EagleModel, load_eagle, save_eagle
from speclab.families.eagle.model3 import Eagle3Model
from speclab.families.eagle.training import hass_forward
from speclab.models.loading import load_model
from speclab.models.tiny import build_tiny_llama
from tests.interop.eagle_layout import eagle3_state, eagle_state, layout_problems

ROOT = Path(__file__).resolve().parents[2]
INTEROP = ROOT / ".venv" / "interop"
RUNNER = ROOT / "tests" / "interop" / "run_speculators.py"
H, V, LAYERS = 32, 100, 8  # the tiny target (8 layers: EAGLE-3's default (2, 4, 5))
T = 128  # speculators' flex-attention masks extend by whole 128-token blocks
STEPS = 3
#: what speculators' Eagle3DraftModel never saves and fills from the verifier on load
#: (core.py _keys_to_ignore_on_save: the frozen verifier LM head and final norm of its
#: training loss); everything else must come from the file
FROM_VERIFIER = {"verifier_lm_head.weight", "verifier_norm.weight"}


def interop_env(path: Path = INTEROP) -> Path:
    """``path`` when speculators is installed there; else skip, or fail under CI."""
    if (path / "speculators" / "__init__.py").is_file():
        return path
    why = (f"{path} has no speculators: `make setup` installs tests/interop/requirements.txt "
           f"there (pip install --no-deps --target {path} -r tests/interop/requirements.txt)")
    if os.environ.get("CI"):
        pytest.fail(f"CI is set and {why}")
    pytest.skip(why)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


#: EAGLE-3 variant drafters (EagleMeta fields; all perturbed, reduced vocabulary)
VARIANTS = {"nbr": {"residual_norm": True},  # speculators' norm_before_residual
            "nbf": {"fc_input_norm": True},  # norm_before_fc (input_norm)
            "e31": {"fc_state_norms": True, "feed_normed": True},  # fc_norm + norm_output
            "bias": {"qkv_bias": True, "o_bias": True},  # attention_bias
            "all": {"residual_norm": True, "fc_state_norms": True, "feed_normed": True,
                    "qkv_bias": True, "o_bias": True},
            "ths": {"hidden_size": 48, "target_hidden_size": H}}  # target_hidden_size
#: variant -> what the refusal of ``--format speculators`` names (others are written)
SPECULATORS_VARIANT_REFUSED = {"ths": "target_hidden_size=32 differs from the drafter's "
                                      "hidden_size=48: speculators 0.9.0 sizes fc"}
#: variant -> what the refusal of ``--format eagle`` names, from EAGLE's cnets.py (which
#: builds the EAGLE-3 attention with bias=False and has no norm_before_* / fc_norm)
EAGLE_VARIANT_REFUSED = {"nbr": "(norm_before_residual)", "nbf": "(norm_before_fc)",
                         "e31": "(norm_output (speculators'))",
                         "bias": "q/k/v/o_proj with bias=False",
                         "all": "(norm_before_residual)"}


def _variant(base: Eagle3Model, **fields) -> Eagle3Model:
    """A drafter with ``base``'s meta but ``fields``; ``base``'s draft vocabulary, and its
    embedding and LM head where as wide; the rest freshly initialised."""
    model = Eagle3Model(replace(base.meta, **fields))
    theirs = base.state_dict()
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if name in ("embed.weight", "lm_head.weight", "d2t", "t2d") \
                    and t.shape == theirs[name].shape:
                t.copy_(theirs[name])
    return model


def _perturb(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every trainable tensor moved off its initial value (norms off 1, so a swapped
    norm changes the output), the embedding and LM head left as the target's."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("embed.", "lm_head.")):
                continue
            p.add_(torch.randn(p.shape, generator=g) * (0.1 if p.ndim == 1 else 0.2))
    return model


def _cli(*argv: str) -> tuple[int, str, str]:
    """``speclab`` in this process: (status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The drafters (speclab folders), their exports and what the CLI printed."""
    root = tmp_path_factory.mktemp("interop")
    target_dir = str(build_tiny_llama(root / "target", seed=11, vocab_size=V, hidden_size=H,
                                      num_layers=LAYERS))
    target = load_model(target_dir)
    torch.manual_seed(0)
    reduced = Eagle3Model.from_target(target, draft_ids=torch.arange(0, V, 2))
    # a drafter configured for fewer positions than its target: the export says the target's
    short = Eagle3Model(replace(reduced.meta, max_positions=64))
    short.load_state_dict(reduced.state_dict())
    drafters = {"e3-reduced": _perturb(short, 1),
                "e3-full": _perturb(Eagle3Model.from_target(target), 2),
                **{f"v-{k}": _perturb(_variant(reduced, **fields), 10 + i)
                   for i, (k, fields) in enumerate(VARIANTS.items())},
                "e1": _perturb(EagleModel.from_target(target, 1, False, False), 3),
                # two layers (layer 1 has its input norm) and an fc without a bias
                "e1-2layers": _perturb(EagleModel(replace(
                    EagleModel.from_target(target, 2, False, False).meta, fc_bias=False)), 4)}
    mine = {k: save_eagle(m, root / f"mine-{k}") for k, m in drafters.items()}
    out, printed = {}, {}

    def export(name: str, src, fmt: str, *extra: str) -> tuple[int, str, str]:
        res = _cli("export", str(src), "--format", fmt, "--out", str(root / name), *extra)
        out[name], printed[name] = root / name, res[1]
        return res

    for k in ("e3-reduced", "e3-full"):
        assert export(f"spec-{k}", mine[k], "speculators", "--target", target_dir,
                      "--speculative-tokens", "4")[0] == 0
        assert export(f"eagle-{k}", mine[k], "eagle", "--target", target_dir)[0] == 0
    for k in VARIANTS:
        for fmt, why in (("speculators", SPECULATORS_VARIANT_REFUSED.get(k)),
                         ("eagle", EAGLE_VARIANT_REFUSED.get(k))):
            rc, _, err = export(f"{fmt[:4]}-v-{k}", mine[f"v-{k}"], fmt, "--target",
                                target_dir)
            assert rc == (2 if why else 0), err
            if why:  # refused by name, nothing half-written
                assert f"--format {fmt}: cannot write" in err and why in err, err
                assert not any((root / f"{fmt[:4]}-v-{k}").glob("*"))
    # a public EAGLE-3 checkpoint (which records no target architecture) to speculators
    assert export("spec-from-eagle", out["eagle-e3-reduced"], "speculators",
                  "--target", target_dir)[0] == 0
    for k in ("e1", "e1-2layers"):
        assert export(f"eagle-{k}", mine[k], "eagle")[0] == 0
    refused = export("spec-e1", mine["e1"], "speculators", "--target", target_dir)
    return {"root": root, "target_dir": target_dir, "target": target, "drafters": drafters,
            "mine": mine, "out": out, "printed": printed, "refused": refused}


#: speculators export -> the drafter it was made from
SPECULATORS_CASES = {"spec-e3-reduced": "e3-reduced", "spec-e3-full": "e3-full",
                     "spec-from-eagle": "e3-reduced",
                     **{f"spec-v-{k}": f"v-{k}" for k in VARIANTS
                        if k not in SPECULATORS_VARIANT_REFUSED}}
#: EAGLE layout exports -> the drafter they were made from
EAGLE_CASES = {"eagle-e3-reduced": "e3-reduced", "eagle-e3-full": "e3-full",
               "eagle-e1": "e1", "eagle-e1-2layers": "e1-2layers",
               **{f"eagl-v-{k}": f"v-{k}" for k in VARIANTS if k not in EAGLE_VARIANT_REFUSED}}


@pytest.fixture(scope="module")
def speculators_run(exports):
    """speculators' code on every speculators export, in ONE subprocess: its JSON report
    (by case name) and the inputs it ran on."""
    env_dir = interop_env()
    root = exports["root"]
    g = torch.Generator().manual_seed(5)
    inputs = root / "inputs.safetensors"
    save_file({"features": torch.randn(1, T, 3 * H, generator=g),
               "input_ids": torch.randint(0, V, (1, T), generator=g)}, str(inputs))
    cases = [{"name": name, "folder": str(exports["out"][name]), "inputs": str(inputs),
              "out": str(root / f"{name}.speculators.safetensors")}
             for name in SPECULATORS_CASES]
    manifest = root / "manifest.json"
    manifest.write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONPATH": str(env_dir), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(RUNNER), str(manifest)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert report["speculators"] == "0.9.0"  # the pinned version, not another install
    assert Path(report["module"]).is_relative_to(env_dir)
    by_name = {c["name"]: c for c in report["cases"]}
    for name, case in by_name.items():
        assert "error" not in case, f"{name}: {case.get('traceback')}"
    return {"cases": by_name, "inputs": load_file(str(inputs))}


# --- speculators' own code on the speculators exports ------------------------------


@pytest.mark.parametrize("name", list(SPECULATORS_CASES))
def test_speculators_parses_the_config_of_each_export(name, exports, speculators_run):
    case = speculators_run["cases"][name]["config"]
    meta = exports["drafters"][SPECULATORS_CASES[name]].meta
    target = exports["target"].config
    assert case["config_class"] == "Eagle3SpeculatorConfig"
    assert case["speculators_model_type"] == "eagle3" and case["algorithm"] == "eagle3"
    assert case["fields_not_in_class"] == ["torch_dtype"]  # PretrainedConfig's own
    assert case["draft_vocab_size"] == (meta.draft_vocab_size or V)
    assert (case["norm_before_residual"], case["norm_before_fc"], case["fc_norm"],
            case["norm_output"]) == (meta.residual_norm, meta.fc_input_norm,
                                     meta.fc_state_norms, meta.feed_normed)
    assert case["target_hidden_size"] in (None, H)
    assert case["eagle_aux_hidden_state_layer_ids"] == list(meta.feature_layers) == [2, 4, 5]
    assert (case["layer_config_class"], case["layer_model_type"]) == ("LlamaConfig", "llama")
    layer = case["layer"]
    assert (layer["vocab_size"], layer["hidden_size"], layer["num_hidden_layers"]) == (V, H, 1)
    assert (layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]) == (
        meta.heads, meta.kv_heads or meta.heads, H // meta.heads)
    assert layer["intermediate_size"] == meta.intermediate_size
    assert layer["attention_bias"] is (meta.qkv_bias and meta.o_bias)
    assert layer["mlp_bias"] is False
    assert layer["max_position_embeddings"] == max(meta.max_positions,
                                                   target.max_position_embeddings)
    assert case["verifier"] == {"name_or_path": exports["target_dir"],
                                "architectures": ["LlamaForCausalLM"]}
    assert case["speculative_tokens"] == (4 if name.startswith("spec-e3") else 5)


@pytest.mark.parametrize("name", list(SPECULATORS_CASES))
def test_speculators_loads_every_tensor_from_the_file(name, exports, speculators_run):
    load = speculators_run["cases"][name]["load"]
    meta = exports["drafters"][SPECULATORS_CASES[name]].meta
    assert load["model_class"] == "Eagle3DraftModel" and load["training"] is False
    assert load["unexpected"] == [] and load["mismatched"] == []
    assert set(load["missing"]) == FROM_VERIFIER
    assert FROM_VERIFIER <= set(load["keys_to_ignore_on_save"])  # speculators never saves them
    assert load["differs_from_file"] == [] and load["nan"] == []
    assert load["use_draft_vocab"] is bool(meta.draft_vocab_size)
    assert load["target_layer_ids"] == list(meta.feature_layers)
    tensors = load_file(str(exports["out"][name] / "model.safetensors"))
    # a full-vocabulary drafter has no d2t / t2d in speculators (its buffers are None)
    assert ({"d2t", "t2d"} <= set(tensors)) is bool(meta.draft_vocab_size)


@pytest.mark.parametrize("name", list(SPECULATORS_CASES))
def test_speculators_forward_computes_what_the_drafter_computes(name, exports,
                                                                 speculators_run):
    """One step, and speculators' 3-step training-time test: its step k at position j
    (input ids shifted left by k, its own step k-1 output at j fed back, positions + k)
    is speclab's step k+1 of :func:`hass_forward` at pair j + k (same token, same
    context, the same relative positions). The state compared is the one speculators
    hands its next step (tests/interop/run_speculators.py): the final norm's output
    under norm_output (speclab's feed_normed), the layer's output otherwise."""
    forward = speculators_run["cases"][name]["forward"]
    meta = exports["drafters"][SPECULATORS_CASES[name]].meta
    assert forward["norm_output"] is meta.feed_normed
    assert forward["fed_back"] == ["norm" if meta.feed_normed else "layer"] * (STEPS - 1)
    theirs = load_file(forward["out"])
    feats = speculators_run["inputs"]["features"]
    ids = speculators_run["inputs"]["input_ids"]
    drafter = load_eagle(exports["mine"][SPECULATORS_CASES[name]]).eval()
    draft = drafter.draft_ids
    with torch.no_grad():
        out, logits = drafter(feats, ids)
        steps = hass_forward(drafter, feats, ids, STEPS)
    tol = {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(theirs["one.logits"], logits[..., draft], **tol)
    torch.testing.assert_close(theirs["one.hidden"], out, **tol)
    for k, (h, lg) in enumerate(steps):
        n = T - k  # speculators' last k positions read padding ids: not compared
        torch.testing.assert_close(theirs[f"ttt.logits.{k}"][:, :n], lg[:, k:][..., draft],
                                   **tol)
        torch.testing.assert_close(theirs[f"ttt.hidden.{k}"][:, :n], h[:, k:], **tol)
        assert torch.equal(theirs[f"ttt.tokens.{k}"][:, :n], lg[:, k:][..., draft].argmax(-1))
    # the steps differ (a fed-back state that were ignored would repeat step 1)
    assert (theirs["ttt.logits.1"][:, : T - 1] - theirs["ttt.logits.0"][:, 1:]).abs().max() > 1e-2


# --- the EAGLE code's layout --------------------------------------------------------


def _state(folder: Path) -> dict[str, torch.Tensor]:
    """The weights EAGLE's ea_model.py reads: pytorch_model.bin first."""
    assert (folder / "pytorch_model.bin").is_file(), sorted(p.name for p in folder.iterdir())
    return torch.load(folder / "pytorch_model.bin", weights_only=True)


@pytest.mark.parametrize("name", list(EAGLE_CASES))
def test_the_eagle_export_has_the_eagle_codes_keys_and_shapes(name, exports):
    folder = exports["out"][name]
    cfg = json.loads((folder / "config.json").read_text())
    state = _state(folder)
    meta = exports["drafters"][EAGLE_CASES[name]].meta
    eagle3 = meta.version == 3
    assert layout_problems({k: tuple(t.shape) for k, t in state.items()}, cfg, eagle3) == []
    if meta.target_hidden_size:  # cnets.py: fc reads 3 * target_hidden_size
        assert cfg["target_hidden_size"] == meta.target_hidden_size != cfg["hidden_size"]
        assert tuple(state["fc.weight"].shape) == (meta.hidden_size, 3 * H)
    assert cfg["num_hidden_layers"] == meta.layers
    if eagle3:
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]  # SGLang's class
        assert "bias" not in cfg or cfg["bias"] is False  # SGLang: fc bias = config.bias
        assert set(state) == set(eagle3_state(cfg))  # all of it, embedding included
        assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    else:
        assert cfg.get("bias", True) is meta.fc_bias
        assert set(state) == set(eagle_state(cfg))


def test_the_layout_check_finds_what_the_eagle_code_would_drop_or_miss(exports):
    """The check has teeth: speclab's own layout (layer 0's input norm, a final norm), a
    missing tensor and a wrong shape are each named."""
    cfg = json.loads((exports["out"]["eagle-e1"] / "config.json").read_text())
    state = {k: tuple(t.shape) for k, t in _state(exports["out"]["eagle-e1"]).items()}
    bad = {**state, "layers.0.input_layernorm.weight": (H,), "norm.weight": (H,)}
    del bad["layers.0.mlp.up_proj.weight"]
    bad["fc.weight"] = (H, 3 * H)
    assert layout_problems(bad, cfg, eagle3=False) == [
        f"missing layers.0.mlp.up_proj.weight ({cfg['intermediate_size']}, {H})",
        f"unexpected layers.0.input_layernorm.weight ({H},)", f"unexpected norm.weight ({H},)",
        f"fc.weight: ({H}, {3 * H}) != ({H}, {2 * H})"]
    cfg3 = json.loads((exports["out"]["eagle-e3-reduced"] / "config.json").read_text())
    state3 = {k: tuple(t.shape) for k, t in _state(exports["out"]["eagle-e3-reduced"]).items()}
    del state3["d2t"]  # a reduced vocabulary needs its map (the loader keeps the buffer)
    assert layout_problems(state3, {**cfg3, "target_hidden_size": None}, eagle3=True) == [
        "target_hidden_size: None (fc reads 3 * target_hidden_size when the key exists)"]
    assert layout_problems(state3, cfg3, eagle3=True) == ["missing d2t (50,)"]


# --- refusals and hints ---------------------------------------------------------------


def test_an_eagle12_drafter_is_refused_for_speculators_naming_format_eagle(exports):
    rc, _, err = exports["refused"]
    assert rc == 2, err
    assert "--format speculators" in err and "--format eagle" in err
    assert not any((exports["root"] / "spec-e1").glob("*"))  # nothing half-written


def test_the_export_command_prints_how_each_runtime_serves_it(exports, tmp_path):
    from speclab.export_cli import serve_hints

    spec = exports["out"]["spec-e3-reduced"]
    printed = exports["printed"]["spec-e3-reduced"]
    draft = json.dumps({"model": str(spec), "method": "eagle3", "num_speculative_tokens": 4})
    assert f"vllm serve {exports['target_dir']} --speculative-config '{draft}'" in printed
    # vLLM takes a speculators folder alone only when its verifier is a hub id
    assert f"vllm serve {spec} " not in printed and "needs speculators_config" in printed
    cfg = json.loads((spec / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = "org/hub-target"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hints = serve_hints("speculators", tmp_path)
    assert hints[0].endswith(f"vllm serve {tmp_path}")
    assert "vllm serve org/hub-target --speculative-config" in hints[1]
    for name, algo in (("eagle-e3-full", "EAGLE3"), ("eagle-e1", "EAGLE")):
        printed = exports["printed"][name]
        assert f"--speculative-algorithm {algo} --speculative-draft-model-path " \
               f"{exports['out'][name]}" in printed
        assert f"use_eagle3={algo == 'EAGLE3'})" in printed
    # SGLang's EAGLE-1/2 fc always has a bias: a drafter without one is not offered to it
    printed = exports["printed"]["eagle-e1-2layers"]
    assert "sglang.launch_server" not in printed and "EaModel.from_pretrained(" in printed


def test_a_missing_interop_env_skips_here_and_fails_under_ci(tmp_path, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="make setup"):
        interop_env(tmp_path)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI is set"):
        interop_env(tmp_path)
    (tmp_path / "speculators").mkdir()
    (tmp_path / "speculators" / "__init__.py").write_text("")
    assert interop_env(tmp_path) == tmp_path
