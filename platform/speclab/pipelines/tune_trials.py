"""Stage: Ray Tune trainables for sweeps whose trials TRAIN something (the tune job).

Both build their Ray Train trainer inside the trial (the Ray Train V2 pattern) through
:func:`speclab.pipelines.fit.fit`, in chunks of ``train.report_every`` steps: each chunk resumes
the last checkpoint of the same run, and after each chunk a held-out figure is reported
so ASHA can stop bad trials early. The last report carries the sweep objective.

* :func:`head_trial`: a SpecDec++ acceptance head (``sweep.kind: train_head``); reports
  the held-out unweighted BCE, then decodes ``specdecpp`` with the head.
* :func:`rec_trial`: an AtSpeed drafter (``sweep.kind: atspeed``) trained with
  ``rec_eval.draft_loss`` / ``rec_eval.align_alpha`` on alignment data generated once per
  sweep (:func:`prepare_rec_sweep`); reports the validation loss, then runs beam SD
  against the target's beam search and reports AS@K / WS@K / Recall@K / NDCG@K.
* :func:`eagle_trial`: an EAGLE-family drafter (``sweep.kind: eagle``: the ``eagle``
  group's loss, HASS K / steps / weights, TALF trees) on ``feat`` / ``feat_tree`` data
  generated once per sweep; reports ``val_loss``, ``val_top1`` (and ``val_top1_miss``
  = 1 - val_top1, what ASHA minimises: comparable across loss weights) and the
  engine-measured ``engine_tau`` per chunk, then decodes ``method`` with the drafter.

Every model a trial loads to score or decode (target, draft, the held-out drafter features,
the trained head or drafter) is in ``models.dtype`` on ``models.device``, which the tune
job sets to the trial's own device (:func:`speclab.sweep.trial_device`: ``cuda`` when the
trial reserved a GPU). Ray Train's workers inside a trial take their own resources
(``scaling``), not the trial's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from speclab.config import TuneJob

if TYPE_CHECKING:
    from speclab.decoding.runner import ModelRunner
    from speclab.recommend import Recommender


def _chunks(steps: int, every: int) -> list[int]:
    """Step counts at which a chunked training trial reports: every, 2*every, ..., steps."""
    return [min(done, steps) for done in range(every, steps + every, every)]


def _train_in_chunks(cfg: TuneJob, steps: int, make_task, name: str, run_dir: str,
                     data_dir: str, vocab: int, eos: int | None, held_out):
    """Ray Train for ``steps`` steps in chunks of ``train.report_every`` (each chunk
    resumes the last checkpoint of run ``name`` under ``<run_dir>/trials``).

    ``make_task(train)`` builds the task config for a chunk's ``train`` group;
    ``held_out(result, done) -> metrics`` scores it. Every chunk but the last is reported
    (ASHA may stop the trial there). Returns the last (result, metrics)."""
    from ray import tune

    from speclab.pipelines.fit import fit

    for done in _chunks(steps, cfg.train.report_every):
        task = make_task(cfg.train.model_copy(update={"steps": done}))
        result = fit(task, cfg.scaling, Path(run_dir) / "trials", name, Path(data_dir), vocab,
                     eos, None, None)
        metrics = held_out(result, done)
        if done < steps:  # intermediate result: ASHA may stop the trial here
            tune.report(metrics)
    return result, metrics


def _trained_head(result, depth: int):
    import torch

    from speclab.decoding.acceptance_head import AcceptanceHead

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

    from speclab.config.method import parse_method
    from speclab.decoding.acceptance_head import save_head
    from speclab.pipelines.head import held_out_metrics
    from speclab.sweep import evaluate_method, log_start, objective, trial_config
    from speclab.train.tasks import HeadTaskConfig

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

    _, metrics = _train_in_chunks(
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


def prepare_rec_sweep(cfg: TuneJob, meta, examples, sweep_dir: Path,
                      tracker) -> tuple[str, Path]:
    """(target folder, data folder) shared by every AtSpeed trial of a sweep.

    The target is ``rec_eval.target`` or trained now; the alignment data for
    ``rec_eval.draft_loss`` is generated once on Ray tasks (AtSpeed-S with
    ``mix_lambda < 1`` first trains an sft drafter for the mixture, unless
    ``rec_eval.drafts`` gives one). The data folder holds everything the training
    tasks read (:func:`speclab.pipelines.recommender.write_data`).
    """
    from speclab.pipelines.alignment import alignment_rows, ensure_target, train_drafters
    from speclab.pipelines.recommender import write_data

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
              eos: int, run_dir: str) -> None:
    """Tune function trainable for AtSpeed trials: train one drafter, then beam SD.

    The drafter has ``rec_eval.draft_arch`` and trains ``rec_eval.draft_steps`` steps
    with ``rec_eval.draft_loss`` (AtSpeed weight ``rec_eval.align_alpha``); evaluation
    uses ``rec_eval.ns`` / ``ks`` / ``gamma`` and the first ``rec_eval.verify`` rule on
    ``rec_eval.test_users`` test users. Metrics: ``as_at_k``, ``ws_at_k``,
    ``recall_at_k``, ``ndcg_at_k`` (for the largest K <= N), ``target_calls_per_user``.
    """
    import json

    from ray import tune

    from speclab.data.rec_dataset import RecExample, RecMeta
    from speclab.pipelines.fit import save_final
    from speclab.rec_eval import evaluate
    from speclab.sweep import log_start, objective, trial_config
    from speclab.train.tasks import RecAlignTaskConfig, RecTaskConfig

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

    result, metrics = _train_in_chunks(
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
    from speclab.decoding.runner import ModelRunner
    from speclab.models.loading import load_model
    from speclab.recommend import Recommender

    m = cfg.models
    rec = Recommender.from_pretrained(target, dtype=m.dtype, device=m.device)
    return rec, ModelRunner(load_model(draft, m.dtype, m.device, field="rec_eval draft"))


def eagle_trial(config: dict, *, base: dict, target: str, draft: str | None, data_dir: str,
                prompts: list[list[int]], t_draft: float, t_target: float, vocab: int,
                eos: int | None, run_dir: str) -> None:
    """Tune function trainable for EAGLE-family drafter trials (see the module docstring).

    Ray Train runs in chunks of ``train.report_every`` steps, each resuming the last
    checkpoint of the same run; the drafter is then saved under
    ``<run_dir>/trials/eagle-<trial>/eagle`` and ``method`` (an ``eagle`` method) decodes
    the prompts with it: ``tau``, ``speedup`` and the cost-model ``predicted_speedup``
    (``t_draft``: one EAGLE drafter forward, measured once per sweep).
    """
    from ray import tune

    from speclab.config.method import parse_method
    from speclab.pipelines.eagle import save_final_eagle
    from speclab.sweep import evaluate_method, log_start, objective, trial_config
    from speclab.train.tasks import EagleTaskConfig

    log_start(run_dir, config["params"], base)
    cfg = trial_config(base, config["params"])
    name = "eagle-" + tune.get_context().get_trial_id()

    def held_out(result, done: int) -> dict:
        metrics = {k: float(v) for k, v in result.metrics.items()
                   if k in ("val_loss", "val_top1", "engine_tau")}
        return {**metrics, "val_top1_miss": 1.0 - metrics["val_top1"],
                "step": int(result.metrics["step"])}

    result, metrics = _train_in_chunks(
        cfg, cfg.train.steps, lambda train: EagleTaskConfig(train=train, eagle=cfg.eagle,
                                                            target=target),
        name, run_dir, data_dir, vocab, eos, held_out)
    folder = save_final_eagle(result, target, Path(run_dir) / "trials" / name)
    m = parse_method({**cfg.method.model_dump(exclude_none=True), "eagle_model": str(folder)})
    metrics.update(evaluate_method(cfg, target, draft, prompts, None, t_draft, t_target, m))
    metrics["objective"] = objective(metrics, base["sweep"])
    tune.report(metrics)
