"""The configuration reference page (``docs/configuration.md``), generated from the
config models, so it cannot drift from them: every group of every job with each
field's type, default and description, and every registered method's knobs.

``python -m speclab.config.reference`` prints it; ``make docs`` writes it.
"""

from __future__ import annotations

import json
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from speclab.config.jobs import JOB_CONFIGS
from speclab.config.method import MethodSpec
from speclab.drafters.registry import BUILTIN

INTRO = """# Configuration reference

Every job reads one YAML file of config groups (`--config`), with `key=value`
overrides on the command line (`method.gamma=5`, `train.steps=100`). A job refuses the
groups it does not use, naming them; the `config.yaml` a run logs holds only the job's
own groups, so it loads back as is. This page is generated from the config models
(`platform/speclab/config/`) by `python -m speclab.config.reference` (`make docs`); a
test keeps it equal to them.
"""


def _type_name(annotation: Any) -> str:
    """A short, readable name of a field's type."""
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    text = text or str(annotation)
    for noise in ("typing.", "speclab.config.schema.", "speclab.config.method.",
                  "speclab.config.jobs.", "pydantic.functional_validators.", "NoneType"):
        text = text.replace(noise, "None" if noise == "NoneType" else "")
    return text.replace("|", "\\|")


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.default
    if value is PydanticUndefined or field.default_factory is not None:
        try:
            value = field.get_default(call_default_factory=True)
        except Exception:  # a factory that needs context: say so
            return "(computed)"
    if isinstance(value, BaseModel):
        return "(group defaults)"
    try:
        text = json.dumps(value, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"`{text}`".replace("|", "\\|")


def _describe(field) -> str:
    text = (field.description or "").replace("\n", " ").replace("|", "\\|")
    signs = {"Ge": ("ge", ">="), "Gt": ("gt", ">"), "Le": ("le", "<="), "Lt": ("lt", "<")}
    meta = [f"{sign} {getattr(m, attr)}" for m in field.metadata
            for attr, sign in [signs.get(type(m).__name__, (None, None))] if attr]
    return (text + (f" ({', '.join(meta)})" if meta else "")).strip()


def model_table(model: type[BaseModel]) -> list[str]:
    """A markdown table of ``model``'s fields: name, type, default, description."""
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        rows.append(f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} | "
                    f"{_describe(field)} |")
    return rows


def groups() -> dict[str, tuple[type, list[str]]]:
    """``{group: (its model class or None for a plain field, the jobs using it)}``: the
    class of the first job using it (:func:`extensions` lists the subclasses others use)."""
    out: dict[str, tuple[type, list[str]]] = {}
    for job, cls in JOB_CONFIGS.items():
        for name, field in cls.model_fields.items():
            entry = out.setdefault(name, (field.annotation, []))
            entry[1].append(job)
    return out


def extensions(group: str, base: type) -> dict[type, list[str]]:
    """``{subclass of base: the jobs whose group ``group`` is it}``: a group some jobs
    extend with fields of their own (``arch`` in the distillation jobs)."""
    out: dict[type, list[str]] = {}
    for job, cls in JOB_CONFIGS.items():
        field = cls.model_fields.get(group)
        ann = field.annotation if field is not None else None
        if isinstance(ann, type) and ann is not base and issubclass(ann, base):
            out.setdefault(ann, []).append(job)
    return out


def extension_lines(sub: type[BaseModel], base: type[BaseModel], jobs: list[str]) -> list[str]:
    """The fields ``sub`` adds to ``base``, as a table introduced by the jobs using it."""
    rows = [r for r, name in zip(model_table(sub)[2:], sub.model_fields, strict=True)
            if name not in base.model_fields]
    doc = " ".join((sub.__doc__ or "").split())
    return [f"In {', '.join(f'`{j}`' for j in jobs)}: {doc}", "",
            *model_table(sub)[:2], *rows, ""]


def reference() -> str:
    """The whole page (markdown)."""
    lines = [INTRO, "## Groups by job", "", "| job | groups |", "|---|---|"]
    for job, cls in JOB_CONFIGS.items():
        lines.append(f"| `{job}` | {', '.join(f'`{g}`' for g in cls.model_fields)} |")
    lines.append("")
    for name, (annotation, jobs) in sorted(groups().items()):
        lines += [f"## `{name}`", "", f"Used by: {', '.join(f'`{j}`' for j in jobs)}.", ""]
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and \
                not issubclass(annotation, MethodSpec):
            if annotation.__doc__:
                lines += [" ".join(annotation.__doc__.split()), ""]
            lines += model_table(annotation) + [""]
            for sub, sub_jobs in extensions(name, annotation).items():
                lines += extension_lines(sub, annotation, sub_jobs)
        elif name in ("method", "methods"):
            lines += ["A method of the method registry: `name` picks it, the other fields "
                      "are its knobs (below, per method). `methods` is a list of them.", ""]
        else:
            lines += [f"Type: {_type_name(annotation)}.", ""]
    lines += ["## Methods and their knobs", "",
              "The built-in methods (a plugin module's methods are listed by `speclab "
              "generate --help` once `$SPECLAB_PLUGINS` names it).", ""]
    for cls in BUILTIN:
        name = cls.model_fields["name"].default
        lines += [f"### `{name}`", ""]
        if cls.__doc__:
            lines += [" ".join(cls.__doc__.split()), ""]
        lines += model_table(cls) + [""]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(reference(), end="")
