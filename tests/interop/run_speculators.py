"""Run speculators' own reading code on speculators-format drafter folders; print JSON.

    PYTHONPATH=.venv/interop python tests/interop/run_speculators.py MANIFEST.json

``MANIFEST.json``: ``[{"name", "folder", "inputs", "out"}]``: a folder to read,
a safetensors file with ``features [1, T, k * H]`` (float32) and ``input_ids [1, T]``
(int64), and where to write what speculators computes from them. For each folder:

- the config through ``SpeculatorModelConfig.from_pretrained`` (the registry picks the
  class from ``speculators_model_type``), its parsed fields reported;
- the model through ``SpeculatorModel.from_pretrained`` (the registry picks the model
  class; it also reads the verifier named in the config: its depth for the target
  layers, its hidden size, the weights the drafter takes from it), its state dict
  compared with the file: missing / unexpected keys, shape mismatches, tensors that
  differ from the file, tensors still NaN (speculators' marker of "never loaded");
- its forward (``Eagle3DraftModel.forward(hidden_states, input_ids, document_ids,
  ttt_steps=...)``, which returns only the drafted token ids) with ``ttt_steps`` 1 and
  3, the draft-vocabulary logits of each step taken from ``lm_head`` by a forward hook;
  the state fed back to the next step is what speculators itself hands the decoder
  layer there (the hidden half of ``layers[0]``'s input at step K + 1, by a forward
  pre-hook), reported per step as ``fed_back``: ``norm`` (the final norm's output,
  which speculators feeds back under ``norm_output``), ``layer`` (``layers[-1]``'s
  output, otherwise) or ``neither``; for the last step (and the one-step run), which
  feed nothing back, the state of the rule the config's ``norm_output`` names;
  written to ``out`` as ``one.logits``, ``one.hidden`` and ``ttt.{logits,hidden,tokens}.K``.

stdout holds only the JSON list (the libraries' logs go to stderr); a case that raises
reports ``error`` and the others still run. Imports nothing of speclab.
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from importlib.metadata import version
from pathlib import Path


def _config_report(folder: Path) -> dict:
    """What speculators' config class makes of ``folder/config.json``."""
    from speculators import SpeculatorModelConfig

    raw = json.loads((folder / "config.json").read_text())
    cfg = SpeculatorModelConfig.from_pretrained(str(folder))
    layer = cfg.transformer_layer_config
    spec = cfg.speculators_config
    return {
        "config_class": type(cfg).__name__,
        "speculators_model_type": cfg.speculators_model_type,
        "fields_not_in_class": sorted(set(raw) - set(type(cfg).model_fields)),
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": cfg.eagle_aux_hidden_state_layer_ids,
        "layer_config_class": type(layer).__name__,
        "layer_model_type": layer.model_type,
        "layer": {k: getattr(layer, k, None) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
            "rms_norm_eps", "max_position_embeddings", "attention_bias", "mlp_bias")},
        "algorithm": spec.algorithm,
        "speculative_tokens": spec.proposal_methods[0].speculative_tokens,
        "default_proposal_method": spec.default_proposal_method,
        "verifier": {"name_or_path": spec.verifier.name_or_path,
                     "architectures": list(spec.verifier.architectures)},
    }


def _load_report(folder: Path):
    """The model speculators loads from ``folder`` and how its state dict compares with
    the weight file."""
    import torch
    from safetensors.torch import load_file
    from speculators import SpeculatorModel

    model = SpeculatorModel.from_pretrained(str(folder)).eval()
    file = load_file(str(folder / "model.safetensors"))
    state = model.state_dict()
    common = sorted(set(state) & set(file))
    mismatched = [k for k in common if tuple(state[k].shape) != tuple(file[k].shape)]
    differs = [k for k in common if k not in mismatched
               and not torch.equal(state[k].to(file[k].dtype), file[k])]
    cls = type(model)
    return model, {
        "model_class": cls.__name__,
        "missing": sorted(set(state) - set(file)),
        "unexpected": sorted(set(file) - set(state)),
        "mismatched": mismatched,
        "differs_from_file": differs,
        "nan": sorted(k for k, v in state.items()
                      if v.is_floating_point() and bool(v.isnan().any())),
        "keys_to_ignore_on_save": list(getattr(cls, "_keys_to_ignore_on_save", None) or []),
        "keys_to_ignore_on_load_missing": list(cls._keys_to_ignore_on_load_missing or []),
        "use_draft_vocab": bool(getattr(model, "use_draft_vocab", False)),
        "target_layer_ids": list(model.config.eagle_aux_hidden_state_layer_ids or []),
        "training": model.training,
    }


def _forward(model, inputs: Path, out: Path) -> dict:
    """Eagle3DraftModel.forward with ttt_steps 1 and 3 on ``inputs``; tensors to ``out``
    (module docstring), the source of each fed-back state in the report."""
    import torch
    from safetensors.torch import load_file, save_file

    data = load_file(str(inputs))
    feats, ids = data["features"], data["input_ids"]
    docs = torch.zeros_like(ids)  # one document
    seen: dict[str, list] = {"logits": [], "layer": [], "norm": [], "fed": []}

    def layer_input(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]  # cat([embeds, hidden])
        seen["fed"].append(x[..., x.shape[-1] // 2:].detach().clone())

    hooks = [model.lm_head.register_forward_hook(
                 lambda m, i, o: seen["logits"].append(o.detach())),
             model.layers[-1].register_forward_hook(
                 lambda m, i, o: seen["layer"].append(o.detach())),
             model.norm.register_forward_hook(lambda m, i, o: seen["norm"].append(o.detach())),
             model.layers[0].register_forward_pre_hook(layer_input, with_kwargs=True)]
    rule = "norm" if model.config.norm_output else "layer"
    tensors = {}
    with torch.no_grad():
        model(feats, ids, docs, ttt_steps=1)
        tensors["one.logits"], tensors["one.hidden"] = seen["logits"][0], seen[rule][0]
        for v in seen.values():
            v.clear()
        tokens = model(feats, ids, docs, ttt_steps=3)
    for hook in hooks:
        hook.remove()
    fed_back = []
    for k in range(len(tokens) - 1):  # what step k + 1 was handed, against both sources
        got = seen["fed"][k + 1]
        fed_back.append(next((name for name in ("norm", "layer")
                              if torch.equal(got, seen[name][k])), "neither"))
    for k, (lg, tok) in enumerate(zip(seen["logits"], tokens, strict=True)):
        fed = seen["fed"][k + 1] if k + 1 < len(tokens) else seen[rule][k]
        tensors.update({f"ttt.logits.{k}": lg, f"ttt.hidden.{k}": fed, f"ttt.tokens.{k}": tok})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out))
    return {"steps": len(tokens), "logits_shape": list(seen["logits"][0].shape),
            "out": str(out), "norm_output": bool(model.config.norm_output),
            "fed_back": fed_back}


def run_case(case: dict) -> dict:
    """One manifest entry -> its report (``error``: the exception, when one was raised)."""
    folder = Path(case["folder"])
    report: dict = {"name": case["name"], "folder": str(folder)}
    try:
        report["config"] = _config_report(folder)
        model, report["load"] = _load_report(folder)
        report["forward"] = _forward(model, Path(case["inputs"]), Path(case["out"]))
    except Exception as exc:  # reported, so that the other cases still run
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()[-3000:]
    return report


def main(argv: list[str]) -> int:
    """Read the manifest ``argv[0]``, print the JSON list of reports."""
    cases = json.loads(Path(argv[0]).read_text())
    with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the JSON
        import speculators

        reports = [run_case(c) for c in cases]
    print(json.dumps({"speculators": version("speculators"), "module": speculators.__file__,
                      "cases": reports}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
