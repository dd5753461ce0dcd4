"""Stage: AtSpeed alignment data and drafters (recommend_eval, tune).

:func:`generate_alignment` computes the target's (or a drafter/target mixture's) top-K
beams on Ray tasks; :func:`alignment_rows` caches them per kind;
:func:`ensure_target` checks a given recommender or trains one; :func:`train_drafters`
trains one drafter per loss (and AtSpeed weight), each with its own training task.
"""

from __future__ import annotations

from typing import Any

from speclab.config.schema import RecEvalConfig
from speclab.pipelines.recommender import train_model


def generate_alignment(target: str, draft: str | None, meta, prompts: list[list[int]],
                       k: int, lam: float, tasks: int) -> list[dict]:
    """Alignment rows (:func:`speclab.families.atspeed.training.alignment_example`) for ``prompts``,
    computed by ``tasks`` Ray tasks (0: one per cluster CPU), each loading the models
    once for its contiguous chunk; rows come back in prompt order."""
    import ray

    @ray.remote(num_cpus=1)
    def chunk(part: list[list[int]]) -> list[dict]:
        import torch

        from speclab.decoding.runner import ModelRunner
        from speclab.families.atspeed.training import alignment_example
        from speclab.models.loading import load_model

        torch.set_num_threads(1)
        runner = ModelRunner(load_model(target, field="rec_eval.target"))
        d = ModelRunner(load_model(draft, field="rec_eval.drafts")) if draft else None
        trie = meta.trie()
        return [alignment_example(runner, trie, p, k, d, lam) for p in part]

    n = tasks or max(1, int(ray.cluster_resources().get("CPU", 1)))
    size = -(-len(prompts) // n)
    refs = [chunk.remote(prompts[i: i + size]) for i in range(0, len(prompts), size)]
    return [row for part in ray.get(refs) for row in part]


def ensure_target(cfg: Any, meta, examples, storage, run_name: str, tracker) -> str:
    """``rec_eval.target`` (checked against the configured data), or a target trained
    now with ``arch`` / ``train`` as a child run (registered when ``output.register_as``).
    ``cfg``: a recommend_eval or tune (atspeed) config."""
    from speclab.data.rec_dataset import RecMeta
    from speclab.models.loading import resolve_source
    from speclab.train.tasks import RecTaskConfig

    re, reg = cfg.rec_eval, cfg.output.register_as
    if re.target:
        target = str(resolve_source(re.target, "rec_eval.target"))
        given = RecMeta.load(target)
        if (given.items, given.codes) != (meta.items, [list(c) for c in meta.codes]):
            raise ValueError("rec_eval.target: its rec_meta.json (items / semantic ids) does "
                             "not match the rec data this config builds")
        return target
    with tracker.child(f"{cfg.name}-target", cfg.model_dump(mode="json")) as c:
        return str(train_model(RecTaskConfig(train=cfg.train, arch=cfg.arch), cfg.scaling,
                               meta, examples, storage, f"{run_name}-target", c,
                               f"{reg}-target" if reg else None))


def alignment_rows(re: RecEvalConfig, examples, meta, target: str, loss: str,
                   drafts: dict[str, str], cache: dict[str, list[dict]],
                   tracker) -> list[dict] | None:
    """Alignment data for a drafter trained with ``loss`` (None for sft), generated once
    per kind into ``cache``: the target's top-``re.align_k`` beams, or for AtSpeed-S with
    ``re.mix_lambda < 1`` the beams of the mixture with ``drafts["sft"]``."""
    import time

    from speclab.models.loading import resolve_source

    if loss == "sft":
        return None
    kind = "mix" if loss == "atspeed_s" and re.mix_lambda < 1.0 else "target"
    if kind not in cache:
        t0 = time.perf_counter()
        draft, lam = None, 1.0
        if kind == "mix":
            draft = str(resolve_source(drafts["sft"], "rec_eval.drafts.sft"))
            lam = re.mix_lambda
        prompts = [e.prompt for e in examples["train"][: re.align_examples]]
        cache[kind] = generate_alignment(target, draft, meta, prompts, re.align_k, lam,
                                         re.align_tasks)
        secs = time.perf_counter() - t0
        tracker.log_metrics({f"align_{kind}_s": secs})
        print(f"[align] alignment data ({kind}, lambda={lam:g}): {len(prompts)} "
              f"histories x top-{re.align_k} in {secs:.0f}s", flush=True)
    return cache[kind]


def train_drafters(cfg: Any, meta, examples, target: str, storage, run_name: str,
                   tracker, given: dict[str, str] | None = None,
                   losses: list[str] | None = None) -> dict[str, str]:
    """One drafter per loss (default ``rec_eval.losses``; per ``rec_eval.align_alphas``
    value for atspeed_s / atspeed_r) not already in ``given`` (name -> folder/URI, e.g.
    ``sft``, ``atspeed_s@0.5``), each a child run. Alignment data is generated once per
    kind on Ray tasks: the target's top-K beams, and for AtSpeed-S (``mix_lambda < 1``)
    the top-K beams of the mixture with the sft drafter, which is therefore trained
    first (added if absent). The drafter's loss and alpha go to its training task, not
    into the config."""
    from speclab.families.atspeed.task import RecAlignTaskConfig
    from speclab.train.tasks import RecTaskConfig

    re, reg = cfg.rec_eval, cfg.output.register_as
    losses = list(re.losses if losses is None else losses)
    mixed = "atspeed_s" in losses and re.mix_lambda < 1.0
    losses = list(dict.fromkeys(["sft", *losses] if mixed else losses))
    losses.sort(key=lambda name: name != "sft")  # sft first: the mixture needs it
    cache: dict[str, list[dict]] = {}
    drafts: dict[str, str] = dict(given or {})
    train = cfg.train.model_copy(update={"steps": re.draft_steps})
    for loss in losses:
        alphas = re.align_alphas if loss.startswith("atspeed") else [None]
        for alpha in alphas:
            name = f"{loss}@{alpha:g}" if loss.startswith("atspeed") else loss
            if name in drafts:
                continue  # given by the config
            rows = alignment_rows(re, examples, meta, target, loss, drafts, cache, tracker)
            if rows is None:
                task = RecTaskConfig(train=train, arch=re.draft_arch)
            else:
                task = RecAlignTaskConfig(train=train, arch=re.draft_arch, loss=loss,
                                          align_k=re.align_k,
                                          **({} if alpha is None else {"align_alpha": alpha}))
            slug = name.replace("@", "-a")
            with tracker.child(f"{cfg.name}-draft-{slug}", task.model_dump(mode="json")) as c:
                c.set_tags({"loss": loss, "alpha": str(alpha)})
                drafts[name] = str(train_model(
                    task, cfg.scaling, meta, examples, storage, f"{run_name}-draft-{slug}", c,
                    f"{reg}-draft-{slug}" if reg else None,
                    extra={"align.pt": rows} if rows is not None else None))
    return drafts
