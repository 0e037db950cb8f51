"""Validation shared by every layer store backend (names become paths on disk)."""

from __future__ import annotations

from dsec.api.layers import LayerInfo, check_layer_name, check_layer_version
from dsec.errors import InvalidArgument

LayerRecord = LayerInfo


def check_name(name: str) -> str:
    try:
        return check_layer_name(name)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def check_version(version: str) -> str:
    try:
        return check_layer_version(version)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
