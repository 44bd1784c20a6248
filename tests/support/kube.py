"""Kubernetes objects checked strictly against the `kubernetes` client's own models: each
key must be a field of its model, each value of the field's type."""
from __future__ import annotations

from typing import Any

import pytest

k8s = pytest.importorskip("kubernetes.client", reason="the `kubernetes` test dependency")


def check_model(value: Any, type_name: str, where: str, errors: list[str]) -> None:
    # the client spells containers `List[X]` / `Dict[str, X]` (older: `list[X]` / `dict(str, X)`)
    if type_name.lower().startswith("list["):
        if not isinstance(value, list):
            errors.append(f"{where}: expected a list")
            return
        for i, item in enumerate(value):
            check_model(item, type_name[5:-1], f"{where}[{i}]", errors)
        return
    if type_name.lower().startswith(("dict(", "dict[")):
        inner = type_name[len("dict(str, "):-1]
        if not isinstance(value, dict):
            errors.append(f"{where}: expected a mapping")
            return
        for key, item in value.items():
            check_model(item, inner, f"{where}.{key}", errors)
        return
    primitive = {"str": (str,), "int": (int,), "bool": (bool,), "float": (int, float),
                 "datetime": (str,)}
    if type_name == "object":
        return  # IntOrString and free-form fields
    if type_name in primitive:
        ok = isinstance(value, primitive[type_name]) and not (
            type_name in ("int", "float") and isinstance(value, bool))
        if not ok:
            errors.append(f"{where}: expected {type_name}, got {type(value).__name__} {value!r}")
        return
    model = getattr(k8s, type_name)
    if not isinstance(value, dict):
        errors.append(f"{where}: expected a {type_name} mapping")
        return
    json_to_attr = {json_name: attr for attr, json_name in model.attribute_map.items()}
    for key, item in value.items():
        if key not in json_to_attr:
            errors.append(f"{where}: unknown field '{key}' for {type_name}")
            continue
        check_model(item, model.openapi_types[json_to_attr[key]], f"{where}.{key}", errors)
