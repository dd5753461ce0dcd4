"""Medusa heads: ``K`` small heads on the target's last hidden state (pure PyTorch).

Head ``k`` (``k = 1..K``) at position ``t`` predicts the token ``x_{t+k+1}`` (the target's
own LM head, "head 0", predicts ``x_{t+1}``), as on the slides' "MEDUSA heads" page::

    h~_t^(k) = SiLU(W1^(k) h_t) + h_t,    p_t^(k) = softmax(W2^(k) h~_t^(k))

``h_t`` is the target's last-layer feature (the LM head's input, after the final norm).
``W1`` starts at zero and ``W2`` as a copy of the target's LM head, so an untrained head
repeats the target's next-token distribution.

On disk (``save_pretrained`` style): ``config.json`` (a :class:`MedusaMeta`: the target
the heads belong to — its name, architecture, sizes and a fingerprint of its LM head —
and ``K``), ``model.safetensors`` and, once calibrated, ``tree.json``: the heads'
measured top-``r`` accuracies and the sparse tree built from them
(:mod:`speclab.families.medusa.trees`). :func:`load_medusa` also loads Medusa's own
formats (:mod:`speclab.models.formats.medusa_format`: ``config.json`` with
``medusa_num_heads`` and ``medusa_lm_head.safetensors`` / ``.pt``, legacy "version 2"
heads that use the target's LM head, MEDUSA-2 models with ``medusa_head.*`` in their
weights); MEDUSA-1 heads carry no target fingerprint (only their shapes are checked
against a target).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from speclab.models.loading import load_model

KIND = "speclab-medusa"


def target_fingerprint(target: nn.Module) -> str:
    """A short hash of ``target``'s LM head weights rounded to bfloat16 (the same for a
    float32 and a bfloat16 copy of one model; different after MEDUSA-2 fine-tuning)."""
    return weight_fingerprint(target.get_output_embeddings().weight)


def weight_fingerprint(weight: torch.Tensor) -> str:
    """:func:`target_fingerprint` of an LM head weight ``[V, H]`` itself (e.g. read from a
    checkpoint file without building the model)."""
    w = weight.detach().to("cpu", torch.bfloat16)
    return hashlib.sha1(w.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()[:16]


@dataclass(frozen=True)
class MedusaMeta:
    """What a set of Medusa heads is and which target it belongs to."""

    target: str
    target_architecture: str
    hidden_size: int
    vocab_size: int
    heads: int = 4
    fingerprint: str = ""
    kind: str = KIND
    #: how many times each head applies its ONE residual block (Medusa's
    #: ``medusa_num_layers``: its code repeats one ``ResBlock`` module; 1: speclab's heads)
    blocks: int = 1
    #: True: imported Medusa "version 2" heads, which use the target's LM head; ``w2[k]``
    #: holds a copy of it (and ``fingerprint`` is that target's)
    shared_lm_head: bool = False

    @classmethod
    def for_target(cls, model: nn.Module, name: str, heads: int) -> MedusaMeta:
        """The meta of ``heads`` heads for ``model`` (a HF causal LM) named ``name``."""
        config = model.config
        arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
        return cls(target=str(name), target_architecture=arch,
                   hidden_size=int(config.hidden_size), vocab_size=int(config.vocab_size),
                   heads=heads, fingerprint=target_fingerprint(model))

    def check_target(self, model: nn.Module, field: str = "medusa_model",
                     fingerprint: str | None = None) -> None:
        """A ValueError naming ``field`` when ``model`` is not the target these heads were
        trained on (another shape, or other LM head weights, e.g. MEDUSA-2 heads used with
        the original target). ``fingerprint``: ``model``'s, when already computed."""
        config = model.config
        for name, have in (("hidden_size", int(config.hidden_size)),
                           ("vocab_size", int(config.vocab_size))):
            if getattr(self, name) != have:
                raise ValueError(f"{field}: heads trained for a target with {name}="
                                 f"{getattr(self, name)}, but the target has {have}")
        if self.fingerprint and self.fingerprint != (fingerprint or target_fingerprint(model)):
            raise ValueError(f"{field}: heads trained for target {self.target!r} (LM head "
                             f"fingerprint {self.fingerprint}); the loaded target has other "
                             f"weights (MEDUSA-2 heads belong to the fine-tuned model saved "
                             f"with them: pass that model as the target)")


class MedusaHeads(nn.Module):
    """``K`` residual heads, each with its own LM head (see the module docstring). The
    heads' weights are stacked (``w1 [K, H, H]``, ``b1 [K, H]``, ``w2 [K, V, H]``), so all
    ``K`` heads run as two batched matmuls: a round's draft costs two kernel launches,
    not ``2K``. ``meta.blocks > 1`` (imported Medusa heads with ``medusa_num_layers > 1``)
    applies each head's residual block that many times, as Medusa's code does."""

    def __init__(self, meta: MedusaMeta) -> None:
        super().__init__()
        self.meta = meta
        k, h, v = meta.heads, meta.hidden_size, meta.vocab_size
        self.w1 = nn.Parameter(torch.zeros(k, h, h))
        self.b1 = nn.Parameter(torch.zeros(k, h))
        self.w2 = nn.Parameter(torch.zeros(k, v, h))
        self.tree: dict | None = None  # the calibration of tree.json, once loaded

    @classmethod
    def from_target(cls, target: nn.Module, name: str, heads: int = 4) -> MedusaHeads:
        """Fresh heads for ``target``: ``W1 = 0``, ``W2`` = the target's LM head."""
        model = cls(MedusaMeta.for_target(target, name, heads))
        lm = target.get_output_embeddings().weight
        with torch.no_grad():
            model.w2.copy_(lm.detach()[None].expand_as(model.w2))
        return model.to(lm.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [..., H]`` -> logits ``[K, ..., V]`` (head ``k`` at index ``k - 1``)."""
        lead = hidden.shape[:-1]
        x = hidden.reshape(1, -1, hidden.shape[-1]).to(self.w1.dtype)  # [1, N, H]
        res = x.expand(self.meta.heads, -1, -1)  # [K, N, H]
        for _ in range(self.meta.blocks):  # Medusa repeats one block medusa_num_layers times
            res = res + F.silu(torch.baddbmm(self.b1[:, None, :], res,
                                             self.w1.transpose(1, 2)))  # [K, N, H]
        logits = torch.bmm(res, self.w2.transpose(1, 2))  # [K, N, V]
        return logits.reshape(self.meta.heads, *lead, -1)


def save_medusa(model: MedusaHeads, folder: str | Path, tree: dict | None = None) -> Path:
    """Write ``config.json``, ``model.safetensors`` and (when given) ``tree.json``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(asdict(model.meta), indent=2))
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    if tree is not None:
        (folder / "tree.json").write_text(json.dumps(tree, indent=1))
    return folder


def is_medusa_folder(folder: str | Path) -> bool:
    """True when ``folder`` holds heads written by :func:`save_medusa`."""
    try:
        return json.loads((Path(folder) / "config.json").read_text()).get("kind") == KIND
    except (OSError, ValueError):
        return False


def load_medusa(folder: str | Path, target: nn.Module | None = None,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                field: str = "medusa_model", target_config=None) -> MedusaHeads:
    """Load heads written by :func:`save_medusa` or in Medusa's own formats
    (:func:`speclab.models.formats.detect_drafter_format`); ``model.tree``: the
    ``tree.json`` calibration, or None. With ``target`` (the loaded target model) heads
    trained for another target are a ValueError naming ``field``; ``target_config`` (the
    target's HF config) checks a public checkpoint's shapes, naming its file. Medusa's
    legacy "version 2" heads (no LM head of their own) need ``target``: its LM head is
    copied into each head."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not is_medusa_folder(folder):
        from speclab.models.formats import load_public_medusa

        model = load_public_medusa(folder, target_config if target is None
                                   else target.config, field, target=target)
        if target is not None:
            model.meta.check_target(target, field)
        return model.to(device=device, dtype=dtype).eval()
    data = json.loads((folder / "config.json").read_text())
    meta = MedusaMeta(**{k: v for k, v in data.items() if k in MedusaMeta.__dataclass_fields__})
    if target is not None:
        meta.check_target(target, field)
    model = MedusaHeads(meta)
    model.load_state_dict(load_file(str(folder / "model.safetensors")))
    model = model.to(device=device, dtype=dtype).eval()
    tree_file = folder / "tree.json"
    model.tree = json.loads(tree_file.read_text()) if tree_file.exists() else None
    return model


@torch.no_grad()
def head_accuracies(heads: MedusaHeads, features: torch.Tensor, tokens: torch.Tensor,
                    top: int = 10, chunk: int = 32) -> list[list[float]]:
    """Calibration: ``acc[k-1][r]`` = fraction of positions where head ``k``'s ``r``-th
    most likely token (``r = 0..top-1``) is the true token ``x_{t+k+1}``.

    ``features [B, L, H]``: the target's features at inputs ``tokens[:, :L]``;
    ``tokens [B, L+1]``. Sequences go through the heads ``chunk`` at a time (the logits
    of all of them at once would be ``K x B x L x V`` floats)."""
    n_heads, length = heads.meta.heads, features.shape[1]
    hits = torch.zeros(n_heads, top)
    for start in range(0, features.shape[0], chunk):
        logits = heads(features[start: start + chunk])  # [K, b, L, V]
        for k in range(1, n_heads + 1):
            span = length - k
            if span > 0:
                ranked = logits[k - 1, :, :span].topk(top, dim=-1).indices  # [b, span, top]
                truth = tokens[start: start + chunk, k + 1: k + 1 + span, None]
                hits[k - 1] += (ranked == truth).float().sum((0, 1)).cpu()
    counts = [features.shape[0] * max(length - k, 0) for k in range(1, n_heads + 1)]
    return [(hits[k] / counts[k]).tolist() if counts[k] else [0.0] * top
            for k in range(n_heads)]


def is_medusa_heads(model: object) -> bool:
    """Whether ``model`` is a set of Medusa heads (the family's artifact)."""
    return isinstance(model, MedusaHeads)


def lm_head_fingerprint(folder: str, config) -> str:
    """:func:`target_fingerprint` of the target in ``folder``: its LM head (or the tied
    embedding) read from the safetensors files; the whole model is loaded only when they
    do not hold it."""
    from types import SimpleNamespace

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # the parameter names, no weights
        skeleton = AutoModelForCausalLM.from_config(config)
    head = skeleton.get_output_embeddings().weight
    names = [n for n, p in skeleton.named_parameters(remove_duplicate=False) if p is head]
    names.append("lm_head.weight")
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            keys = set(f.keys())
            for name in names:
                if name in keys:
                    lm = SimpleNamespace(weight=f.get_tensor(name))
                    return target_fingerprint(SimpleNamespace(
                        get_output_embeddings=lambda h=lm: h))
    return target_fingerprint(load_model(folder, field="models.target"))


def check_artifact(model: MedusaHeads, target_config, field: str, target_source: str | None,
                   target_vocab: int) -> None:
    """The family's artifact check (Serve's draft replica at load): ValueError naming
    ``field`` unless the heads were trained for the target (its config and its LM
    head's fingerprint, read from the target's folder ``target_source`` without loading
    the model; without the folder, the vocabulary ``target_vocab`` alone)."""
    from types import SimpleNamespace

    if target_config is None:
        if int(model.meta.vocab_size) != int(target_vocab):
            raise ValueError(f"{field}: heads trained for a target with vocab_size="
                             f"{model.meta.vocab_size}, but the target has {target_vocab}")
        return
    fingerprint = lm_head_fingerprint(target_source, target_config) \
        if model.meta.fingerprint else None
    model.meta.check_target(SimpleNamespace(config=target_config), field, fingerprint)
