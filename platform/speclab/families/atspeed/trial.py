"""AtSpeed in Ray Tune (``sweep.kind: atspeed``): the target and alignment data made
once per sweep (:func:`prepare_rec_sweep`), an AtSpeed drafter trained per trial with
``rec_eval.draft_loss`` / ``rec_eval.align_alpha``; reports the validation loss, then
runs beam SD against the target's beam search and reports AS@K / WS@K / Recall@K /
NDCG@K. The best trial becomes a ``recommend_eval`` config."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speclab.config import TuneJob
from speclab.data.rec_dataset import EOS, RecExample, RecMeta
from speclab.decoding.runner import ModelRunner
from speclab.families.atspeed.stages import alignment_rows, ensure_target, train_drafters
from speclab.families.atspeed.task import RecAlignTaskConfig
from speclab.models.loading import load_model
from speclab.pipelines.fit import save_final
from speclab.pipelines.recommender import prepare_rec, write_data
from speclab.pipelines.tune_trials import train_in_chunks
from speclab.rec_eval import evaluate
from speclab.recommend import Recommender
from speclab.sweep import log_start, objective, trial_config
from speclab.train.tasks import RecTaskConfig


@dataclass
class RecPrep:
    """The recommendation data of a sweep, checked before Ray starts: its meta and
    examples, and the vocabulary and EOS its drafters train with."""

    meta: RecMeta
    examples: Any
    vocab: int
    eos: int


def prepare_sweep(cfg: Any) -> tuple[RecPrep, None]:
    """The recommendation data (:class:`RecPrep`); no draft LM."""
    meta, examples = prepare_rec(cfg)
    return RecPrep(meta, examples, meta.vocab_size, EOS), None


def generate_sweep(cfg: Any, inputs: Any, sweep_dir: Path, tracker) -> None:
    """The target (trained or checked) and the alignment data, once per sweep; the
    sweep's target becomes it (WS@K is measured against the target's search)."""
    p = inputs.train_prep
    inputs.target, _ = prepare_rec_sweep(cfg, p.meta, p.examples, sweep_dir, tracker)


def sweep_steps(cfg: Any) -> int:
    """A trial's training steps: ``rec_eval.draft_steps``."""
    return cfg.rec_eval.draft_steps


def best_config(cfg: Any, params: dict, data: dict, trial_dir: Path, target: str,
                trial: str) -> tuple[str, dict]:
    """The best trial as a ``recommend_eval`` config holding the target and the trial's
    drafter, so nothing is retrained."""
    best_cfg = trial_config(cfg.sweep_base(), params)
    re = best_cfg.rec_eval
    loss = re.draft_loss
    name = f"{loss}@{re.align_alpha:g}" if loss.startswith("atspeed") else loss
    for key in ("draft_loss", "align_alpha"):  # one trial's drafter: given below
        data["rec_eval"].pop(key, None)
    data["rec_eval"].update({
        "target": target, "losses": [loss], "align_alphas": [re.align_alpha],
        "drafts": {name: str(trial_dir / f"draft-{trial}" / "model")}})
    return "recommend_eval", data


def prepare_rec_sweep(cfg: TuneJob, meta, examples, sweep_dir: Path,
                      tracker) -> tuple[str, Path]:
    """(target folder, data folder) shared by every AtSpeed trial of a sweep.

    The target is ``rec_eval.target`` or trained now; the alignment data for
    ``rec_eval.draft_loss`` is generated once on Ray tasks (AtSpeed-S with
    ``mix_lambda < 1`` first trains an sft drafter for the mixture, unless
    ``rec_eval.drafts`` gives one). The data folder holds everything the training
    tasks read (:func:`speclab.pipelines.recommender.write_data`).
    """
    re = cfg.rec_eval
    storage = sweep_dir.parent
    done = sweep_dir / "prepared_target.txt"  # a resumed sweep reuses target and data
    if cfg.train.resume and done.exists() and (sweep_dir / "data" / "examples.json").exists():
        return done.read_text(), sweep_dir / "data"
    target = ensure_target(cfg, meta, examples, storage, sweep_dir.name, tracker)
    drafts = dict(re.drafts)
    if re.draft_loss == "atspeed_s" and re.mix_lambda < 1.0 and "sft" not in drafts:
        drafts = train_drafters(cfg, meta, examples, target, storage, sweep_dir.name,
                                tracker, drafts, losses=["sft"])
    rows = alignment_rows(re, examples, meta, target, re.draft_loss, drafts, {}, tracker)
    data_dir = write_data(meta, examples, sweep_dir / "data",
                          {"align.pt": rows} if rows is not None else None)
    done.write_text(target)
    return target, data_dir


def _pick_row(rows: list[dict]) -> dict:
    """The Table 1 row a trial is scored on: the largest K its N allows."""
    if not rows:
        raise ValueError("rec_eval.ks: no K <= N (and <= the number of items) to evaluate")
    return max(rows, key=lambda r: (r["K"], r["N"]))


def rec_trial(config: dict, *, base: dict, target: str, data_dir: str, vocab: int,
              eos: int, run_dir: str, **unused: Any) -> None:
    """Tune function trainable for AtSpeed trials: train one drafter, then beam SD.

    The drafter has ``rec_eval.draft_arch`` and trains ``rec_eval.draft_steps`` steps
    with ``rec_eval.draft_loss`` (AtSpeed weight ``rec_eval.align_alpha``); evaluation
    uses ``rec_eval.ns`` / ``ks`` / ``gamma`` and the first ``rec_eval.verify`` rule on
    ``rec_eval.test_users`` test users. Metrics: ``as_at_k``, ``ws_at_k``,
    ``recall_at_k``, ``ndcg_at_k`` (for the largest K <= N), ``target_calls_per_user``.
    ``unused``: what the tune job gives every trained family's trial (prompts, forward
    costs) and beam SD does not use.
    """
    del unused
    from ray import tune

    log_start(run_dir, config["params"], base)
    cfg = trial_config(base, config["params"])
    re = cfg.rec_eval
    name = "draft-" + tune.get_context().get_trial_id()
    storage = Path(run_dir) / "trials"

    def make_task(train):
        if re.draft_loss == "sft":
            return RecTaskConfig(train=train, arch=re.draft_arch)
        return RecAlignTaskConfig(train=train, arch=re.draft_arch, loss=re.draft_loss,
                                  align_alpha=re.align_alpha, align_k=re.align_k)

    result, metrics = train_in_chunks(
        cfg, re.draft_steps, make_task, name, run_dir, data_dir, vocab, eos,
        lambda result, done: {"val_loss": float(result.metrics["val_loss"]), "step": done})
    final = save_final(result, re.draft_arch, storage / name, Path(data_dir) / "tokenizer",
                       vocab, eos)
    RecMeta.load(data_dir).save(final)
    rec, draft = rec_models(cfg, target, str(final))
    test = [RecExample(**r) for r in json.loads(
        (Path(data_dir) / "examples.json").read_text())["test"]][: re.test_users]
    row = _pick_row(evaluate(rec, {name: draft}, test, re.ks, re.ns, re.gamma,
                             re.verify[:1], cfg.train.seed))
    metrics.update({"as_at_k": row["AS@K"], "ws_at_k": row["WS@K"],
                    "recall_at_k": row["Recall@K"], "ndcg_at_k": row["NDCG@K"],
                    "target_calls_per_user": row["target_calls_per_user"],
                    "K": row["K"], "N": row["N"]})
    metrics["objective"] = objective(metrics, base["sweep"])
    tune.report(metrics)


def rec_models(cfg: TuneJob, target: str, draft: str) -> tuple[Recommender, ModelRunner]:
    """(:class:`~speclab.recommend.Recommender` of ``target``, ``ModelRunner`` of the
    trial's drafter ``draft``) in ``cfg.models.dtype`` on ``cfg.models.device`` (an
    atspeed sweep has no ``models`` group: float32 on the CPU)."""
    m = cfg.models
    rec = Recommender.from_pretrained(target, dtype=m.dtype, device=m.device)
    return rec, ModelRunner(load_model(draft, m.dtype, m.device, field="rec_eval draft"))


