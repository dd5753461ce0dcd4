"""Online features (``eagle.features: online``): the batch the target computes inside a
training step equals the stored rows' batch (up to their float16 rounding) for EAGLE-1/2
and EAGLE-3 features, so both modes train the same loss; and a global batch is the same
rows on any number of workers."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from speclab.decoding.runner import ModelRunner
from speclab.families.eagle.training import (
    collate_feat,
    eagle3_loss,
    feature_loss,
    online_feat_batch,
)
from speclab.models.tiny import tiny_llama_config
from speclab.train.distill_data import feat_example


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(vocab_size=64, hidden_size=32, num_layers=4)
                            ).eval()


@pytest.mark.parametrize("spec", [None, (1, 2, 3)], ids=["last-layer", "eagle3-fused"])
def test_online_batch_equals_the_offline_rows(target, spec):
    g = torch.Generator().manual_seed(1)
    windows = torch.randint(0, 64, (3, 17), generator=g).tolist()
    offline = collate_feat([feat_example(ModelRunner(target), w, 5, spec) for w in windows])
    rows = [{"tokens": w, "loss_mask": [0] * 5 + [1] * 12} for w in windows]
    online = online_feat_batch(target, rows, 5, spec)
    assert online["features"].shape == offline["features"].shape
    assert torch.equal(online["tokens"], offline["tokens"])
    assert torch.allclose(online["features"], offline["features"], atol=2e-3, rtol=1e-3)
    assert torch.equal(online["topk_ids"], offline["topk_ids"])
    assert torch.allclose(online["topk_probs"], offline["topk_probs"], atol=1e-5)
    assert online["loss_mask"].shape == (3, 17)
    offline["loss_mask"] = online["loss_mask"]  # a conversation's rows carry one alike

    from speclab.families.eagle.model import EagleModel
    from speclab.families.eagle.model3 import Eagle3Model

    torch.manual_seed(0)
    if spec is None:
        drafter = EagleModel.from_target(target, 1).eval()
        a, b = (feature_loss(drafter, x, steps=3, w_topk=1.0, top_k=3)
                for x in (online, offline))
    else:
        drafter = Eagle3Model.from_target(target, spec).eval()
        a, b = (eagle3_loss(drafter, x, steps=3) for x in (online, offline))
    assert torch.allclose(a, b, rtol=1e-4), (float(a), float(b))


def test_a_global_batch_is_the_same_rows_on_any_number_of_workers(monkeypatch):
    import torch.distributed as dist

    from speclab.train.tasks import global_batch_rows

    one, _ = global_batch_rows(7, 3, 0, rows=100, batch_size=8)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    halves = [global_batch_rows(7, 3, r, rows=100, batch_size=4)[0] for r in (0, 1)]
    assert halves[0] + halves[1] == one
    assert global_batch_rows(7, 4, 0, 100, 4)[0] != halves[0]  # another step, other rows


def test_online_objectives_train_on_windows_and_talf_is_refused():
    from speclab.config.schema import EagleTrainConfig
    from speclab.families.eagle.stages import group_kinds

    for loss, version in (("eagle", 1), ("hass", 1), ("eagle3", 3)):
        online = EagleTrainConfig(loss=loss, version=version, features="online")
        assert group_kinds(online) == {"windows"}
        offline = EagleTrainConfig(loss=loss, version=version)
        assert group_kinds(offline) == {"feat3" if version == 3 else "feat"}
    with pytest.raises(ValueError, match="features: online"):
        EagleTrainConfig(loss="talf", features="online")


def test_window_kinds_cut_the_same_windows():
    """Online (``windows``) and offline (``feat`` / ``feat3``) runs, and KD, train on the
    same windows; prompt kinds draw their own."""
    from speclab.config.schema import DistillConfig
    from speclab.pipelines.signals import plan_starts

    tokens = torch.arange(5000) % 97
    d = DistillConfig(examples=20, seq_len=16)
    same = {k: plan_starts(d, 3, tokens, k) for k in ("kd", "windows", "feat", "feat3",
                                                       "feat_tree", "feat3_tree")}
    assert len({tuple(s) for s, _ in same.values()}) == 1
    assert plan_starts(d, 3, tokens, "seq")[0] != same["kd"][0]
    assert plan_starts(d, 4, tokens, "feat")[0] != same["feat"][0]  # another seed
