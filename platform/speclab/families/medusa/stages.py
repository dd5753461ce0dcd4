"""Stage: Medusa heads trained on Ray Train (MEDUSA-1 or MEDUSA-2), calibrated (head
accuracies on held-out prompts' greedy continuations -> the sparse tree stored with
them), saved, registered and evaluated (train_medusa)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from speclab.pipelines.signals import Prepared, prepare_target


def save_final_medusa(result, variant: str, target: str, heads: int, run_dir: Path
                      ) -> tuple[Any, Any, Path]:
    """The last checkpoint as (the target model, the heads, the target's folder). For
    ``medusa2`` the fine-tuned target is written with ``save_pretrained`` (and the
    original's tokenizer) to ``run_dir/target`` and the heads' meta names it."""
    import torch
    from transformers import AutoTokenizer

    from speclab.families.medusa.model import MedusaHeads, MedusaMeta
    from speclab.families.medusa.training import Medusa2Model
    from speclab.models.loading import load_model

    with result.checkpoint.as_directory() as d:
        state = torch.load(Path(d) / "state.pt", weights_only=False)
    model = load_model(target, field="models.target").float()
    fresh = MedusaHeads.from_target(model, target, heads).float()
    if variant == "medusa1":
        fresh.load_state_dict(state["model"])
        return model, fresh, Path(target)
    joint = Medusa2Model(model, fresh)
    joint.load_state_dict(state["model"])
    folder = Path(run_dir) / "target"
    joint.backbone.save_pretrained(folder)
    AutoTokenizer.from_pretrained(target, trust_remote_code=False).save_pretrained(folder)
    joint.heads.meta = MedusaMeta.for_target(joint.backbone, str(folder), heads)
    return joint.backbone.eval(), joint.heads, folder


def calibrate(heads, target_model, sequences: list[tuple[list[int], int]], top: int,
              nodes: int, source: str = "prompts") -> dict:
    """``tree.json``'s content: the heads' top-``top`` accuracies measured with
    ``target_model``'s features on ``sequences`` (``(tokens, first_label)``: a sequence
    and the index of its first scored label, so only the target's own tokens count, as
    in Medusa; lengths may differ), the ``nodes``-node sparse tree built from them, and
    every tree shape's tau two ways: ``expected_tau`` (Medusa's estimate, the product of
    the heads' accuracies along each path: independent heads) and ``replayed_tau`` (each
    shape replayed on the calibration positions: the heads' joint behaviour,
    :func:`~speclab.families.medusa.trees.replayed_length`). ``source`` names the
    sequences' origin in the result (``medusa.calibration``)."""
    import torch

    from speclab.families.medusa.training import hit_rates, own_token_hits, own_token_ranks
    from speclab.families.medusa.trees import (
        cartesian_template,
        chain_template,
        expected_length,
        replayed_length,
        sparse_template,
    )

    k = heads.meta.heads
    hits, counts = torch.zeros(k, top), torch.zeros(k)
    ranks: list[list[tuple[int, ...]]] = []  # per sequence, per position
    groups: dict[tuple[int, int], list[list[int]]] = {}  # same shape: one forward
    for tokens, first in sequences:
        groups.setdefault((len(tokens), first), []).append(tokens)
    for (_, first), rows in groups.items():
        tokens = torch.tensor(rows, dtype=torch.long)
        with torch.no_grad():
            feats = target_model.model(input_ids=tokens[:, :-1]).last_hidden_state
        h, c = own_token_hits(heads, feats, tokens, top, first)
        hits, counts = hits + h, counts + c
        ranks += own_token_ranks(heads, feats, tokens, top, first)
    acc = hit_rates(hits, counts)
    sparse = sparse_template(acc, nodes)
    shapes = {"chain": chain_template(k), "cartesian_2": cartesian_template(2, k),
              f"sparse_{nodes}": sparse}
    return {"accuracies": acc, "calibration": source,
            "calibration_sequences": len(sequences),
            "calibration_labels": counts.tolist(),
            "sparse_nodes": nodes, "sparse": [list(p) for p in sparse],
            "expected_tau": {name: expected_length(t, acc) for name, t in shapes.items()},
            "replayed_tau": {name: replayed_length(t, ranks) for name, t in shapes.items()},
            "replayed_positions": sum(len(r) for r in ranks)}


def held_out_calibration_prompts(cfg: Any) -> list[str]:
    """The texts ``medusa.calibration: prompts`` continues: ``medusa.calibration_prompts``
    held-out prompts of the evaluation's kind
    (:func:`~speclab.data.prompts.held_out_prompts`). ValueError naming
    ``medusa.calibration`` when there are none (a JSONL file holding only the evaluated
    prompts), so :func:`prepare_medusa` refuses it before any work."""
    from speclab.data.prompts import held_out_prompts

    texts = held_out_prompts(cfg.data.prompts, cfg.medusa.calibration_prompts,
                             cfg.data.num_prompts, cfg.data.context_chars, cfg.data.path,
                             cfg.data.seed)
    if not texts:
        raise ValueError(f"medusa.calibration: 'prompts' needs prompts in data.path beyond "
                         f"the {cfg.data.num_prompts} evaluated ones (data.num_prompts); "
                         f"add some or set medusa.calibration: shard")
    return texts


def data_kind(group: Any) -> str:
    """``medusa`` (prompts + the target's greedy continuations, with its features and
    top-k), or ``medusa_windows`` (the tokens alone) when ``medusa.features: online``."""
    return "medusa_windows" if getattr(group, "features", "offline") == "online" else "medusa"


def group_kinds(group: Any) -> set[str]:
    """The data kinds the ``medusa`` group trains on (:func:`data_kind`)."""
    return {data_kind(group)}


def prepare_medusa(cfg: Any) -> Prepared:
    """``train_medusa``'s checks before any work: the target and corpus
    (:func:`~speclab.pipelines.signals.prepare_target`) and, for ``medusa.calibration:
    prompts``, the held-out calibration prompts."""
    if cfg.medusa.calibration == "prompts":
        held_out_calibration_prompts(cfg)
    return prepare_target(cfg)


def calibration_sequences(cfg: Any, target: str, target_model, held_out: Path
                          ) -> list[tuple[list[int], int]]:
    """What ``medusa.calibration`` scores, as ``(tokens, first_label)`` pairs.
    ``prompts``: ``medusa.calibration_prompts`` held-out prompts of the evaluation's kind
    (:func:`held_out_calibration_prompts`), tokenised with ``target``'s
    tokenizer and continued greedily by ``target_model`` (plain decoding, the engine's)
    for ``decoding.max_new_tokens`` tokens, stopping at EOS; scored past the prompt.
    ``shard``: the ``held_out`` training shard's rows, scored past ``distill.prompt_len``."""
    if cfg.medusa.calibration == "shard":
        import pyarrow.parquet as pq

        return [(r["tokens"], cfg.distill.prompt_len)
                for r in pq.read_table(held_out).to_pylist()]
    from speclab.api import Decoder
    from speclab.models.loading import load_tokenizer

    texts = held_out_calibration_prompts(cfg)
    dec = Decoder(target_model, tokenizer=load_tokenizer(target, field="models.target"))
    ids = dec.encode_all(texts)
    out = dec.generate(prompts=ids, method="ar", max_new_tokens=cfg.decoding.max_new_tokens)
    return [(p + r.token_ids, len(p)) for p, r in zip(ids, out) if r.token_ids]


def quality_change(cfg: Any, original: str, tuned_model, prompts: list[list[int]]
                   ) -> dict[str, float]:
    """:func:`~speclab.families.medusa.training.lm_quality` of the fine-tuned target against the
    original on held-out corpus windows (``distill.seq_len`` tokens, up to 64) and the
    evaluation prompts (``decoding.max_new_tokens`` greedy tokens)."""
    from transformers import AutoTokenizer

    from speclab.data.token_stream import token_stream
    from speclab.families.medusa.training import lm_quality
    from speclab.models.loading import load_model

    tok = AutoTokenizer.from_pretrained(original, trust_remote_code=False)
    ids = token_stream(cfg.corpus, tok, "validation").tokens
    length = cfg.distill.seq_len + 1
    n = min(64, ids.numel() // length)
    if n == 0:
        raise ValueError(f"corpus.val_chars: too little held-out text for one window of "
                         f"{length} tokens")
    windows = ids[: n * length].view(n, length)
    return lm_quality(load_model(original, field="models.target").float(), tuned_model,
                      windows, prompts, cfg.decoding.max_new_tokens)


def train_register_evaluate_medusa(cfg: Any, prep: Prepared, storage: Path, run_name: str,
                                   data_dir: Path, tracker, variant: str,
                                   register_as: str | None) -> tuple[Path, str, list[dict]]:
    """Train ``variant``'s heads (``cfg.medusa``, ``train``, ``scaling``) on Ray Train,
    calibrate them (``medusa.calibration``), save and register them, then run ``methods``
    against plain decoding of the variant's target (the original, or MEDUSA-2's
    fine-tuned one), ``medusa`` methods with ``medusa_model: trained`` using these heads.
    Returns (the heads' folder, the target's folder, the evaluation rows, AR first)."""
    from speclab.families.medusa.model import save_medusa
    from speclab.families.medusa.task import MedusaTaskConfig
    from speclab.pipelines.actor_eval import evaluate_trained, tokenized_prompts
    from speclab.pipelines.export import export_final
    from speclab.pipelines.fit import fit

    task = MedusaTaskConfig(train=cfg.train, medusa=cfg.medusa, variant=variant,
                            target=prep.target, prompt_len=cfg.distill.prompt_len)
    t1 = time.perf_counter()
    result = fit(task, cfg.scaling, storage, run_name, data_dir, prep.vocab, prep.eos,
                 tracker.run_id, tracker.uri if tracker.run_id else None)
    run_dir = storage / run_name
    target_model, heads, target = save_final_medusa(result, variant, prep.target,
                                                    cfg.medusa.heads, run_dir)
    held_out = sorted((data_dir / data_kind(cfg.medusa)).glob("shard-*.parquet"))[-1]
    tree = calibrate(heads, target_model,
                     calibration_sequences(cfg, str(target), target_model, held_out),
                     cfg.medusa.calibration_top, cfg.medusa.sparse_nodes,
                     cfg.medusa.calibration)
    folder = save_medusa(heads, run_dir / "medusa", tree)
    export_final(cfg.output.export, folder, str(target), tracker, "train_medusa")
    metrics = {"train_s": time.perf_counter() - t1, "final_step": result.metrics["step"],
               "final_val_loss": result.metrics["val_loss"],
               "final_engine_tau": result.metrics.get("engine_tau", 0.0),
               **{f"expected_tau.{k}": v for k, v in tree["expected_tau"].items()},
               **{f"replayed_tau.{k}": v for k, v in tree["replayed_tau"].items()},
               **{f"head{k}_acc_top{r + 1}": sum(a[: r + 1]) for k, a in
                  enumerate(tree["accuracies"], start=1) for r in (0, 4)
                  if r < len(a)}}
    prompts = tokenized_prompts(cfg, prep.target)
    if variant == "medusa2":
        metrics.update({f"quality.{k}": v for k, v in
                        quality_change(cfg, prep.target, target_model, prompts).items()})
        tracker.log_model(target, f"{register_as}-target" if register_as else None)
    tracker.log_metrics(metrics)
    uri = tracker.log_model(folder, register_as)
    print(f"[train_medusa] {variant} heads saved to {folder}" + (
        f", registered as {uri}" if uri else "") + f"; expected tau {tree['expected_tau']}"
        f", replayed tau {tree['replayed_tau']}", flush=True)
    rows = evaluate_trained(cfg, str(target), prompts, tracker, "medusa_model", str(folder))
    return folder, str(target), rows
