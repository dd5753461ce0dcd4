"""The SpecDec++ acceptance head in Ray Tune (``sweep.kind: train_head``): a head
trained per trial on acceptance data generated once per sweep; reports the held-out
unweighted BCE, then decodes ``specdecpp`` with the head."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from speclab.config.method import parse_method
from speclab.decoding.acceptance_head import AcceptanceHead, save_head
from speclab.families.specdecpp.stages import held_out_metrics, prepare_head
from speclab.families.specdecpp.task import HeadTaskConfig
from speclab.pipelines.signals import generate
from speclab.pipelines.tune_trials import train_in_chunks
from speclab.sweep import evaluate_method, log_start, objective, trial_config


def prepare_sweep(cfg: Any) -> tuple[Any, str]:
    """(the prepared target and corpus, the frozen drafter's folder)."""
    return prepare_head(cfg)


def generate_sweep(cfg: Any, inputs: Any, sweep_dir: Path, tracker) -> None:
    """The ``accept`` data of the drafter, once per sweep."""
    del tracker
    p = inputs.train_prep
    generate(cfg, p.target, sweep_dir / "data", {"accept"}, p.tokens, inputs.draft,
             cfg.head.temperature)


def _trained_head(result, depth: int):
    with result.checkpoint.as_directory() as d:  # on the CPU, whatever device wrote it
        state = torch.load(Path(d) / "state.pt", weights_only=False, map_location="cpu")["model"]
    head = AcceptanceHead(state["out.weight"].shape[1], depth)
    head.load_state_dict(state)
    return head.eval()


def head_trial(config: dict, *, base: dict, target: str, draft: str, data_dir: str,
               prompts: list[list[int]], t_draft: float, t_target: float, vocab: int,
               eos: int | None, run_dir: str) -> None:
    """Tune function trainable for acceptance-head trials.

    Ray Train runs in chunks of ``train.report_every`` steps (each chunk resumes the
    last checkpoint of the same run); after each chunk the held-out UNWEIGHTED BCE,
    ECE and accuracy are reported (comparable across w_acc / w_rej, so ASHA can rank
    trials on them). Finally ``specdecpp`` decodes with the head (its stop threshold
    from ``method``) and the sweep objective is reported.
    """
    from ray import tune

    log_start(run_dir, config["params"], base)
    cfg = trial_config(base, config["params"])
    plain = cfg.head.model_copy(update={"w_acc": 1.0, "w_rej": 1.0})
    name = "head-" + tune.get_context().get_trial_id()
    heads = {}

    def held_out(result, done: int) -> dict:
        heads["last"] = _trained_head(result, cfg.head.depth)
        return {**held_out_metrics(plain, heads["last"], draft, Path(data_dir),
                                   cfg.models.dtype, cfg.models.device),
                "step": int(result.metrics["step"])}

    _, metrics = train_in_chunks(
        cfg, cfg.train.steps, lambda train: HeadTaskConfig(train=train, head=cfg.head,
                                                           draft=draft),
        name, run_dir, data_dir, vocab, eos, held_out)
    head = heads["last"]
    folder = Path(run_dir) / "trials" / name / "head"
    save_head(head, folder)
    m = parse_method({**cfg.method.model_dump(exclude_none=True), "name": "specdecpp",
                     "head": str(folder)})
    metrics.update(evaluate_method(cfg, target, draft, prompts, None, t_draft, t_target, m))
    metrics["objective"] = objective(metrics, base["sweep"])
    tune.report(metrics)


