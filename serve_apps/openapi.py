"""This server's own limits in ``/openapi.json``, on top of what FastAPI derives from the
request bodies (:mod:`serve_apps.protocol`).

* ``max_tokens`` / ``max_completion_tokens``: their maximum is ``serve.max_tokens``.
* ``verify``: an enum of the rules registered when the app is built (the rule registry,
  :mod:`speclab.decoding.rules.registry`, plugin modules included), each described.
* ``verify_params``: each rule's parameter model as a schema component
  (``VerifyParams.<rule>``), and a description of every rule's parameters (type,
  bounds, default).
* no ``422``: FastAPI documents one on every route with a body, but this server answers
  bad input with ``400`` in OpenAI's error shape.
"""

from __future__ import annotations

import re

from pydantic import BaseModel

from speclab.decoding.rules.registry import rules


def server_schema(schema: dict, max_tokens: int) -> dict:
    """``schema`` (FastAPI's) with this server's limits and rules filled in (in place)."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    known = rules()
    refs, lines = [], []
    for name, rule in known.items():
        fields = describe_params(rule.params)
        lines.append(f"{name}: {fields or 'no parameters'}")
        if fields:
            key = "VerifyParams." + re.sub(r"[^A-Za-z0-9._-]", "_", name)
            components[key] = _component(rule.params, components)
            refs.append({"$ref": f"#/components/schemas/{key}"})
    rule_names = ", ".join(f"{n} ({r.doc})" if r.doc else n for n, r in known.items())
    for model in list(components.values()):
        prop = model.get("properties", {})
        for field in ("max_tokens", "max_completion_tokens"):
            for option in _options(prop.get(field)):
                if option.get("type") == "integer":
                    option["maximum"] = max_tokens
        if "verify" in prop and "verify_params" in prop:
            for option in _options(prop["verify"]):
                if option.get("type") == "string":
                    option["enum"] = list(known)
            prop["verify"]["description"] = (
                f"{prop['verify'].get('description', '')}. Registered rules: {rule_names}")
            params = prop["verify_params"]
            no_params = {"type": "object", "maxProperties": 0}
            params["anyOf"] = [*(refs or [no_params]), {"type": "null"}]
            params["description"] = (f"{params.get('description', '')}. Per rule: "
                                     + "; ".join(lines))
    for route in schema.get("paths", {}).values():  # this server answers 400, never 422
        for op in route.values():
            if isinstance(op, dict) and op.get("responses", {}).pop("422", None) is not None:
                op["responses"].setdefault("400", {"description": "invalid request"})
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    return schema


def describe_params(model: type[BaseModel]) -> str:
    """``name (type, bounds, default), ...`` of a rule's parameter model ('' if none)."""
    out = []
    for key, p in model.model_json_schema().get("properties", {}).items():
        bits = [str(p.get("type", "any"))]
        for bound, sign in (("exclusiveMinimum", ">"), ("minimum", ">="),
                            ("exclusiveMaximum", "<"), ("maximum", "<=")):
            if bound in p:
                bits.append(f"{sign} {p[bound]}")
        if "default" in p:
            bits.append(f"default {p['default']}")
        out.append(f"{key} ({', '.join(bits)})")
    return ", ".join(out)


def _component(model: type[BaseModel], components: dict) -> dict:
    """``model``'s JSON schema, its nested definitions moved to ``components``."""
    spec = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(spec.pop("$defs", {}))
    return spec


def _options(prop: dict | None) -> list[dict]:
    """A property's schema and the options of its ``anyOf`` (e.g. ``int | None``)."""
    return [] if prop is None else [prop, *prop.get("anyOf", [])]
