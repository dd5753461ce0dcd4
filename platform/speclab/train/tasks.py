"""Training tasks handed to the Ray Train loop: what a step's batch is and its loss.

Each task has a small typed config (a :class:`TaskConfigBase` subclass selected by
``kind``) holding only what it needs: the ``train`` group, the model's ``arch`` and the
task's own knobs. Jobs build it on the driver and workers get its JSON dump
(re-validated there by :func:`parse_task_config`), never the whole experiment. A task
is built on each worker from its config and a data folder: ``batch(step, rank)`` is
deterministic in (seed, step, rank), so a run resumed from a checkpoint sees the same
data; ``loss(model, batch)``; ``validate(model)`` on held-out data (the :class:`Task`
protocol; :class:`TaskBase` gives the optional parts their defaults).

Tasks are a registry (:func:`register_task`): this module holds the generic ones,

* :class:`LMTask` — next-token cross-entropy on random windows of a token stream
  (target training);
* :class:`DistillTask` — a drafter loss (or a weighted mix) on shards written by the
  distillation job's generation stage; the last shard of each kind is held out;
* :class:`RecTask` — L_Rec on "history -> next item id" examples (AtSpeed's target),

and each trained drafter family registers its own from its folder
(``speclab/families/<family>/task.py``, named by its declaration's ``task_module``:
imported on the first lookup of a kind this module does not hold), as does a family
from a plugin (``$SPECLAB_PLUGINS``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

import pyarrow.parquet as pq
import torch
from pydantic import Field

from speclab.config.base import StrictModel
from speclab.config.schema import ArchConfig, DraftArchConfig, TrainConfig
from speclab.losses import loss_entry
from speclab.train.lm import eval_loss, lm_loss, random_windows


class TaskConfigBase(StrictModel):
    """What every task config has: ``kind`` (the registry key), the optimisation settings
    and the model's architecture (None when the task builds its own model, e.g. the
    acceptance head)."""

    kind: str
    train: TrainConfig = TrainConfig()
    arch: ArchConfig | None = ArchConfig()



class LMTaskConfig(TaskConfigBase):
    kind: Literal["lm"] = "lm"


class DistillTaskConfig(TaskConfigBase):
    """``weights``: loss name -> weight (``distill.loss_weights()``)."""

    kind: Literal["distill"] = "distill"
    arch: DraftArchConfig = DraftArchConfig()
    weights: dict[str, float] = Field(default_factory=lambda: {"word_kd": 1.0})
    hass_k: int | None = None


class RecTaskConfig(TaskConfigBase):
    kind: Literal["rec"] = "rec"


class Task(Protocol):
    """What the training loop calls on a task (:func:`speclab.pipelines.fit.train_loop`)."""

    unused_parameters: bool

    def build_model(self) -> torch.nn.Module | None: ...
    def param_groups(self, model: torch.nn.Module) -> list[dict] | None: ...
    def batch(self, step: int, rank: int) -> Any: ...
    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor: ...
    def tokens_in(self, batch: Any) -> int: ...
    def scored(self, batch: Any) -> float | None: ...
    def validate(self, model: torch.nn.Module) -> float: ...
    def val_metrics(self, model: torch.nn.Module) -> dict[str, float]: ...


class TaskBase:
    """The optional parts of :class:`Task` with their defaults: the loop builds a LLaMA
    from ``arch`` (``build_model`` None), one parameter group, DDP without unused
    parameters, no metrics besides the validation loss."""

    unused_parameters: ClassVar[bool] = False

    def build_model(self) -> torch.nn.Module | None:
        return None

    def param_groups(self, model: torch.nn.Module) -> list[dict] | None:
        del model
        return None

    def val_metrics(self, model: torch.nn.Module) -> dict[str, float]:
        del model
        return {}

    def scored(self, batch: Any) -> float | None:
        """How many positions of ``batch`` the loss averages over, where a loss mask makes
        that differ between workers' slices of one global batch (conversations: the
        assistant tokens); None: every slice counts the same."""
        del batch
        return None


class _Registry(dict):
    """kind -> (task config class, task class); a missing kind imports the families'
    task modules (built-ins and plugins) once, then looks again."""

    def __missing__(self, kind: str):
        from speclab.families.registry import families

        for fam in families().values():
            __import__(fam.task_module)
        if dict.__contains__(self, kind):
            return dict.__getitem__(self, kind)
        raise KeyError(kind)


_REGISTRY: _Registry = _Registry()


def register_task(config: type[TaskConfigBase], task: type) -> type:
    """Register ``task`` for its config class's ``kind`` (``Literal["<kind>"]``)."""
    kind = config.model_fields["kind"].default
    old = dict.get(_REGISTRY, kind)
    if old is not None and (old[0].__qualname__, old[1].__qualname__) != (
            config.__qualname__, task.__qualname__):
        raise ValueError(f"task: a task of kind {kind!r} is already registered")
    _REGISTRY[kind] = (config, task)
    return task


def task_class(kind: str) -> type:
    """The task class registered for ``kind``; ValueError naming the known kinds."""
    try:
        return _REGISTRY[kind][1]
    except KeyError:
        raise ValueError(f"task: unknown kind {kind!r}; known: "
                         f"{', '.join(sorted(_REGISTRY))}") from None


def parse_task_config(data: dict | TaskConfigBase) -> TaskConfigBase:
    """A task config from its JSON dump (what a Ray Train worker receives), validated by
    the class registered for its ``kind``."""
    if isinstance(data, TaskConfigBase):
        return data
    kind = data.get("kind") if isinstance(data, dict) else None
    try:
        config = _REGISTRY[kind][0]
    except KeyError:
        raise ValueError(f"task.kind: unknown kind {kind!r}; known: "
                         f"{', '.join(sorted(_REGISTRY))}") from None
    return config.model_validate(data)


def step_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """The generator of one (step, rank): a batch depends only on them and the seed."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def val_count(batch_size: int) -> int:
    """How many held-out rows a validation reads: 4 global batches (``batch_size`` per
    worker x the workers), so that 2 workers of ``B / 2`` validate on the rows one
    worker of ``B`` does."""
    return batch_size * 4 * _world()


def global_batch_rows(seed: int, step: int, rank: int, rows: int, batch_size: int
                      ) -> tuple[list[int], torch.Generator]:
    """The row indices (of ``rows``) worker ``rank`` trains on at ``step``: its slice of
    ONE draw of ``batch_size x world`` rows made with the step's generator, so that ``W``
    workers of ``batch_size B / W`` see exactly the rows one worker of ``B`` sees (DDP
    averages equal-sized slices: the same gradient). Returns the indices and the
    generator (rank-specific, for what else the batch draws)."""
    world = _world()
    g = step_generator(seed, step, 0)
    idx = torch.randint(0, rows, (batch_size * world,), generator=g).tolist()
    return idx[rank * batch_size: (rank + 1) * batch_size], step_generator(seed, step, rank)


class LMTask(TaskBase):
    """Causal-LM training on ``data_dir/train.pt`` with validation on ``val.pt``."""

    def __init__(self, cfg: LMTaskConfig, data_dir: Path, device: torch.device) -> None:
        self.tr = cfg.train
        self.device = device
        self.tokens = torch.load(Path(data_dir) / "train.pt")
        self.val = torch.load(Path(data_dir) / "val.pt")

    def batch(self, step: int, rank: int) -> torch.Tensor:
        """``[B, seq_len + 1]`` windows."""
        g = step_generator(self.tr.seed, step, rank)
        return random_windows(self.tokens, self.tr.batch_size, self.tr.seq_len, g).to(self.device)

    def loss(self, model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return lm_loss(model, batch)

    def tokens_in(self, batch: torch.Tensor) -> int:
        return batch.numel()

    def validate(self, model: torch.nn.Module) -> float:
        return eval_loss(model, self.val.to(self.device), self.tr.seq_len, self.tr.val_windows)


class DistillTask(TaskBase):
    """A drafter loss (``weights``: ``{name: weight}``) on generated shards. Each loss is
    looked up in the loss registry (:class:`speclab.losses.Loss`): the shards of its data
    kind, its collate and how it is applied; a step draws rows once per data kind and
    collates them once per (kind, collate)."""

    def __init__(self, cfg: DistillTaskConfig, data_dir: Path, device: torch.device) -> None:
        self.tr = cfg.train
        self.device = device
        self.knobs = {"hass_k": cfg.hass_k}
        self.weights = {k: float(w) for k, w in cfg.weights.items() if w > 0}
        self.entries = {name: loss_entry(name) for name in self.weights}
        self.train_rows: dict[str, list[dict]] = {}
        self.val_rows: dict[str, list[dict]] = {}
        for kind in {e.data for e in self.entries.values()}:
            shards = sorted((Path(data_dir) / kind).glob("shard-*.parquet"))
            if len(shards) < 2:
                raise ValueError(f"distill: need >= 2 {kind} shards (one is held out), "
                                 f"found {len(shards)} in {data_dir / kind}")
            self.val_rows[kind] = pq.read_table(shards[-1]).to_pylist()
            self.train_rows[kind] = [r for s in shards[:-1] for r in pq.read_table(s).to_pylist()]

    def _collated(self, rows_of: dict[str, list[dict]]) -> dict[tuple, dict]:
        """``{(kind, collate): batch}`` for every loss in use, each batch on the device."""
        out: dict[tuple, dict] = {}
        for e in self.entries.values():
            key = (e.data, e.collate)
            if key not in out:
                out[key] = {k: v.to(self.device) for k, v in e.collate(rows_of[e.data]).items()}
        return out

    def batch(self, step: int, rank: int) -> dict[tuple, dict]:
        """One collated batch per (data kind, collate) in use."""
        g = step_generator(self.tr.seed, step, rank)
        rows_of = {}
        for kind, rows in self.train_rows.items():
            idx = torch.randint(0, len(rows), (self.tr.batch_size,), generator=g).tolist()
            rows_of[kind] = [rows[i] for i in idx]
        return self._collated(rows_of)

    def loss(self, model: torch.nn.Module, batch: dict[tuple, dict]) -> torch.Tensor:
        return sum(w * e.apply(model, batch[(e.data, e.collate)], e.fn, self.knobs)
                   for e, w in ((self.entries[n], w) for n, w in self.weights.items()))

    def tokens_in(self, batch: dict[tuple, dict]) -> int:
        return sum(int(b["inputs"].numel()) for b in batch.values())

    @torch.no_grad()
    def validate(self, model: torch.nn.Module) -> float:
        model.eval()
        val = self._collated({k: rows[: val_count(self.tr.batch_size)]
                              for k, rows in self.val_rows.items()})
        out = float(self.loss(model, val))
        model.train()
        return out


class RecTask(TaskBase):
    """L_Rec (AtSpeed eq. 37): cross-entropy on the next item's id tokens given the
    history prompt; examples and ``rec_meta.json`` come from ``data_dir``."""

    def __init__(self, cfg: TaskConfigBase, data_dir: Path,
                 device: torch.device) -> None:
        import json

        from speclab.data.rec_dataset import RecExample, RecMeta

        self.tr = cfg.train
        self.device = device
        self.meta = RecMeta.load(data_dir)
        rows = json.loads((Path(data_dir) / "examples.json").read_text())
        self.train = [RecExample(**r) for r in rows["train"]]
        self.val = [RecExample(**r) for r in rows["validation"]] or self.train[:64]

    def _collate(self, examples) -> dict:
        from speclab.data.rec_dataset import collate_rec

        return {k: v.to(self.device) for k, v in collate_rec(examples, self.meta).items()}

    def batch(self, step: int, rank: int) -> dict:
        g = step_generator(self.tr.seed, step, rank)
        idx = torch.randint(0, len(self.train), (self.tr.batch_size,), generator=g).tolist()
        return self._collate([self.train[i] for i in idx])

    def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        from speclab.losses import cross_entropy

        logits = model(input_ids=batch["inputs"]).logits
        return cross_entropy(logits, batch["labels"], batch["mask"])

    def tokens_in(self, batch: dict) -> int:
        return int(batch["inputs"].numel())

    @torch.no_grad()
    def validate(self, model: torch.nn.Module) -> float:
        model.eval()
        out = float(self.loss(model, self._collate(self.val[: val_count(self.tr.batch_size)])))
        model.train()
        return out


class _Tasks:
    """``TASKS[kind]`` -> the task class (a read-only view of the registry)."""

    def __getitem__(self, kind: str) -> type:
        return _REGISTRY[kind][1]

    def __contains__(self, kind: object) -> bool:
        try:
            _REGISTRY[kind]
        except KeyError:
            return False
        return True


TASKS = _Tasks()

register_task(LMTaskConfig, LMTask)
register_task(DistillTaskConfig, DistillTask)
register_task(RecTaskConfig, RecTask)
