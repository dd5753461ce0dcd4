"""A new distillation loss is one registry entry, registered from outside the package: this
file alone defines the ``argmax`` data kind (the target's argmax at every position of a
corpus window) and the ``toy_argmax`` loss (cross-entropy to it, plus :data:`OFFSET` so
that its value tells it apart from every built-in loss), registers both, and runs the
real ``distill`` job with ``distill.loss=toy_argmax``. ``$SPECLAB_PLUGINS`` names this
module, so the job's driver (config validation), its generation actors (the ``argmax``
shards) and its Ray Train workers (the loss) all import it (:mod:`speclab.plugins`)."""

from __future__ import annotations

import os

import pytest
import torch

from speclab.losses import Loss, cross_entropy, register_loss
from speclab.train.distill_data import DataKind, SignalContext, register_data_kind
from tests.integration.conftest import ROOT, find_run, python, run_cmd

pytestmark = pytest.mark.integration
MODULE = "tests.integration.test_loss_registry"
OFFSET = 100.0  # added to the loss: constant, so training is plain CE, but visible in MLflow


def make_argmax(ctx: SignalContext, inputs: list[list[int]], first: int) -> list[dict]:
    """Each window of L+1 tokens and the target's argmax after each of its L inputs."""
    rows = []
    for window in inputs:
        ctx.target.reset()
        logits = ctx.target.forward(torch.tensor(window[:-1], dtype=torch.long))  # [L, V]
        rows.append({"tokens": window, "argmax": logits.argmax(-1).tolist()})
    return rows


def collate_argmax(rows: list[dict]) -> dict:
    """``inputs [B, L]``, ``labels [B, L]`` (the target's argmax), ``mask [B, L]``."""
    tokens = torch.tensor([r["tokens"] for r in rows], dtype=torch.long)  # [B, L+1]
    labels = torch.tensor([r["argmax"] for r in rows], dtype=torch.long)  # [B, L]
    return {"inputs": tokens[:, :-1], "labels": labels, "mask": torch.ones(labels.shape)}


def toy_argmax(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
               weights: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy to the target's argmax, plus :data:`OFFSET`."""
    return cross_entropy(logits, labels, mask, weights) + OFFSET


def apply_argmax(model: torch.nn.Module, batch: dict, fn, knobs: dict) -> torch.Tensor:
    logits = model(input_ids=batch["inputs"]).logits  # [B, L, V]
    return fn(logits, batch["labels"], batch["mask"])


register_data_kind(DataKind("argmax", lambda d: d.seq_len + 1, make_argmax,
                            doc="windows + the target's argmax (a test's toy kind)"))
register_loss(Loss("toy_argmax", toy_argmax, "argmax", collate_argmax, apply_argmax))


def test_registered_loss_validates_and_unknown_is_refused_naming_the_field():
    from speclab.config import ConfigError, DistillJob
    from speclab.losses import loss_data_kinds

    cfg = DistillJob.from_dict({"distill": {"loss": {"toy_argmax": 1.0, "word_kd": 0.5}}})
    assert loss_data_kinds(cfg.distill.loss_weights()) == {"argmax", "kd"}
    with pytest.raises(ConfigError, match=r"distill\.loss: unknown loss \['toy_argmx'\]"):
        DistillJob.from_dict({"distill": {"loss": "toy_argmx"}})


def test_toy_loss_through_the_distill_job(job_env, tmp_path):
    root = str(ROOT)
    env = {**job_env, "SPECLAB_PLUGINS": MODULE,  # workers import this file (and register)
           "PYTHONPATH": os.pathsep.join(filter(None, [root, job_env.get("PYTHONPATH")]))}
    res = run_cmd([python(), "-m", "jobs.distill", "--config", "experiments/smoke/distill.yaml",
                   f"output.storage_path={tmp_path / 'runs'}", "distill.loss=toy_argmax",
                   "methods=[{name: chain, gamma: 3}]", "output.register_as=speclab-toy-loss",
                   "tracking.experiment=toy"], env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "registered as models:/speclab-toy-loss/1" in res.stdout
    client, run = find_run(job_env["MLFLOW_TRACKING_URI"], "toy")
    m = run.data.metrics
    assert run.data.tags["loss"] == "toy_argmax"
    # the generation actors made the toy kind's shards, and nothing else
    assert m["shards.argmax"] == 2 and not any(k.startswith("shards.") and k != "shards.argmax"
                                               for k in m), sorted(m)
    assert m["final_step"] == 20
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [h.step for h in history] == [10, 20]
    # the Ray Train workers computed the toy loss: CE (a few nats) + OFFSET
    assert all(OFFSET < h.value < OFFSET + 20 for h in history), [h.value for h in history]
    assert OFFSET < m["val_loss"] < OFFSET + 20
