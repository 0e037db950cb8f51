"""dsec.api's rule: Strict and Reply alone decide wire compatibility.

Every model of the wire package derives from one of them and keeps its ``extra``, so
whether an unknown field is refused (requests) or ignored (replies) is decided in
dsec.api.base and nowhere else.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from pydantic import BaseModel

import dsec.api
from dsec.api.base import Reply, Strict


def _wire_models() -> list[type[BaseModel]]:
    found: list[type[BaseModel]] = []
    for mod in pkgutil.iter_modules(dsec.api.__path__):
        module = importlib.import_module(f"dsec.api.{mod.name}")
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseModel) and obj.__module__ == module.__name__:
                found.append(obj)
    return found


def test_every_wire_model_is_strict_or_reply() -> None:
    models = _wire_models()
    assert len(models) > 50  # the whole package was found
    for model in models:
        if model in (Strict, Reply):
            continue
        assert issubclass(model, Strict | Reply), model
        expected = "forbid" if issubclass(model, Strict) else "ignore"
        assert model.model_config.get("extra") == expected, model
