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
  3, the draft-vocabulary logits of each step taken from ``lm_head`` and the layer's
  output (the state fed back to the next step) from ``layers[-1]`` by forward hooks;
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
    """Eagle3DraftModel.forward with ttt_steps 1 and 3 on ``inputs``; tensors to ``out``."""
    import torch
    from safetensors.torch import load_file, save_file

    data = load_file(str(inputs))
    feats, ids = data["features"], data["input_ids"]
    docs = torch.zeros_like(ids)  # one document
    logits, hidden = [], []
    hooks = [model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o.detach())),
             model.layers[-1].register_forward_hook(lambda m, i, o: hidden.append(o.detach()))]
    tensors = {}
    with torch.no_grad():
        model(feats, ids, docs, ttt_steps=1)
        tensors["one.logits"], tensors["one.hidden"] = logits[0], hidden[0]
        logits.clear()
        hidden.clear()
        tokens = model(feats, ids, docs, ttt_steps=3)
    for hook in hooks:
        hook.remove()
    for k, (lg, h, tok) in enumerate(zip(logits, hidden, tokens, strict=True)):
        tensors.update({f"ttt.logits.{k}": lg, f"ttt.hidden.{k}": h, f"ttt.tokens.{k}": tok})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out))
    return {"steps": len(tokens), "logits_shape": list(logits[0].shape), "out": str(out)}


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
