"""The EAGLE family's checks and data kinds: pure functions of its training group (and
of the job's other groups), imported by validation without any model, loss or config
module (the declaration names them: ``speclab.families.eagle``)."""

from __future__ import annotations

from typing import Any


def feature_kind(group: Any) -> str:
    """``feat`` (last-layer features) or ``feat3`` (an EAGLE-3 drafter's fused layers);
    ``windows`` (the token windows alone) when the features are computed online."""
    if getattr(group, "features", "offline") == "online":
        return "windows"
    return "feat3" if group.version == 3 else "feat"


def tree_kind(group: Any) -> str:
    """TALF's kinds: the feature kind plus the target-built trees."""
    return f"{feature_kind(group)}_tree"


def last_layer_drafter(group: Any, name: str) -> None:
    """EAGLE's and HASS's regression needs an EAGLE-1/2 drafter (``version: 1``)."""
    if group.version == 3:
        raise ValueError(f"loss: {name!r} regresses the target's last-layer feature, which "
                         "an EAGLE-3 drafter (version 3) does not predict; use eagle3 or talf")


def offline_trees(group: Any, name: str) -> None:
    """TALF trains on target-built trees, generated offline: no online features."""
    if getattr(group, "features", "offline") == "online":
        raise ValueError(f"features: online computes the target's features in the step; "
                         f"{name} trains on target-built trees generated offline")


def eagle3_drafter(group: Any, name: str) -> None:
    """EAGLE-3's training-time test trains an EAGLE-3 drafter (``version: 3``)."""
    if group.version != 3:
        raise ValueError(f"loss: {name} trains an EAGLE-3 drafter; set eagle.version: 3")


def hass_within_top_k(group: Any, job: Any) -> None:
    """HASS distils the target's top-k: ``eagle.hass_k`` must not exceed the top-k that
    the training step reads: ``distill.top_k`` (stored in the offline feature shards) or,
    with ``features: online``, ``eagle.online_top_k`` (computed in the step)."""
    if getattr(group, "features", "offline") == "online":
        field, k, what = "eagle.online_top_k", group.online_top_k, "computed in the step"
    else:
        field, k, what = "distill.top_k", job.distill.top_k, "the stored top-k"
    if group.hass_k > k:
        raise ValueError(f"eagle.hass_k ({group.hass_k}) must not exceed {field} ({k}), "
                         f"{what}")


def talf_within_window(group: Any, job: Any) -> None:
    """TALF's trees must fit in a training window."""
    if group.talf_depth >= job.distill.seq_len:
        raise ValueError(f"eagle.talf_depth ({group.talf_depth}) must be below "
                         f"distill.seq_len ({job.distill.seq_len})")


def windows_leave_tokens(group: Any, job: Any) -> None:
    """``eagle.data: target`` continues each window's first ``data_prompt`` tokens: they
    must leave tokens for the target to generate (every objective, every job)."""
    if group.data == "target" and group.data_prompt >= job.distill.seq_len:
        raise ValueError(f"eagle.data_prompt ({group.data_prompt}) must be below "
                         f"distill.seq_len ({job.distill.seq_len}): data: target continues "
                         "each window's first data_prompt tokens")
