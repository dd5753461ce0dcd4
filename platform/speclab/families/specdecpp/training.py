"""SpecDec++ acceptance-head training batches and metrics (pure PyTorch; no Ray).

Rows come from :func:`speclab.train.distill_data.accept_example` (``prompt``, target
response ``x``, draft tokens ``y``, acceptance probabilities ``p``). A batch mixes them
as in section 3.3: each response position takes the target's token ``x_i`` with
probability ``r`` (``head.mix_ratio``) and the draft's ``y_i`` otherwise; the FROZEN
drafter reads ``prompt + z`` and its final hidden state at every ``y`` position is a
training input with label ``p_i``. Positions holding ``x`` get no loss.
"""

from __future__ import annotations

import torch


class DraftFeatures:
    """The frozen drafter's final hidden states (its LM head's input) for a batch.

    Where the model's decoder (``get_decoder()``) returns exactly its LM head's input as
    ``last_hidden_state`` (checked once, on a short probe), the features come from the
    decoder alone: the LM head is not computed (on SmolLM2's cut draft, 49,152 x 576,
    it is most of a forward). Otherwise a hook reads the head's input in a full forward.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model.eval()
        for prm in model.parameters():
            prm.requires_grad_(False)
        self._last: torch.Tensor | None = None
        model.get_output_embeddings().register_forward_pre_hook(self._grab)
        self.decoder = self._decoder_if_same(model)

    def _grab(self, _module, args) -> None:
        self._last = args[0]

    @torch.no_grad()
    def _decoder_if_same(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """``model.get_decoder()`` when its ``last_hidden_state`` equals the LM head's
        input on a probe of 8 tokens ``[1, 8]``, else None."""
        try:
            decoder = model.get_decoder()
        except (AttributeError, NotImplementedError, ValueError):
            return None
        if not isinstance(decoder, torch.nn.Module) or decoder is model:
            return None
        device = next(model.parameters()).device
        probe = (torch.arange(8, device=device) * 7 % int(model.config.vocab_size))[None]
        model(input_ids=probe)
        want = self._last
        try:
            got = decoder(input_ids=probe).last_hidden_state
        except (AttributeError, TypeError, ValueError):
            return None
        return decoder if got.shape == want.shape and torch.equal(got, want) else None

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @torch.no_grad()
    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs [B, S]`` (right-padded) -> hidden ``[B, S, H]``."""
        if self.decoder is not None:
            return self.decoder(input_ids=inputs).last_hidden_state.float()
        self.model(input_ids=inputs)
        return self._last.float()


def mixed_batch(rows: list[dict], features: DraftFeatures, mix_ratio: float,
                generator: torch.Generator, device: torch.device | str = "cpu") -> dict:
    """``hidden [B, N, H]`` at each response position, labels ``p [B, N]``, and ``mask
    [B, N]`` (True where the position holds the draft's token, i.e. gets a loss)."""
    n = max(len(r["x"]) for r in rows)
    s = max(len(r["prompt"]) + len(r["x"]) for r in rows)
    inputs = torch.zeros(len(rows), s, dtype=torch.long)
    index = torch.zeros(len(rows), n, dtype=torch.long)
    labels = torch.zeros(len(rows), n)
    mask = torch.zeros(len(rows), n, dtype=torch.bool)
    for b, r in enumerate(rows):
        x, y = torch.tensor(r["x"]), torch.tensor(r["y"])
        k, lp = len(x), len(r["prompt"])
        from_x = torch.rand(k, generator=generator) < mix_ratio
        inputs[b, :lp] = torch.tensor(r["prompt"])
        inputs[b, lp: lp + k] = torch.where(from_x, x, y)
        index[b, :k] = torch.arange(lp, lp + k)  # the hidden state AT z_i (after reading it)
        labels[b, :k] = torch.tensor(r["p"])
        mask[b, :k] = ~from_x
    hidden = features(inputs.to(device))
    hidden = hidden.gather(1, index.to(device)[..., None].expand(-1, -1, hidden.shape[-1]))
    return {"hidden": hidden, "p": labels.to(device), "mask": mask.to(device)}


def head_metrics(pred: torch.Tensor, target: torch.Tensor, bins: int = 10) -> dict[str, float]:
    """Calibration and accuracy of predicted acceptance ``pred`` vs labels ``target``
    (both ``[M]`` in [0, 1]): expected calibration error over ``bins`` equal-width bins
    of ``pred``, accuracy of ``pred > 0.5`` against ``target > 0.5``, the mean label
    and the mean prediction."""
    pred, target = pred.float().flatten(), target.float().flatten()
    if pred.numel() == 0:
        raise ValueError("head metrics: no positions to score")
    which = (pred * bins).long().clamp(max=bins - 1)
    ece = 0.0
    for b in range(bins):
        sel = which == b
        if sel.any():
            ece += float(sel.float().mean() * (pred[sel].mean() - target[sel].mean()).abs())
    return {"ece": ece, "accuracy": float(((pred > 0.5) == (target > 0.5)).float().mean()),
            "mean_label": float(target.mean()), "mean_pred": float(pred.mean())}
