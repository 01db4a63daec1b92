"""User adapters named ``"package.module:object"`` (object: an Adapter instance, an Adapter
subclass, a zero-argument factory, or any object with ``wrap`` and ``full_params``)."""

from __future__ import annotations

import importlib
from types import ModuleType

from harness.adapters.base import Adapter, AdapterError, as_adapter


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def import_module(module: str, label: str) -> ModuleType:
    """Import `module` or raise AdapterError saying which module and why."""
    try:
        return importlib.import_module(module)
    except Exception as exc:  # ImportError, SyntaxError, or anything its top level raises
        raise AdapterError(f"adapter {label!r}: module {module!r} could not be imported: {one_line(exc)}") from exc


def load_user_adapter(spec: str) -> Adapter:
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise AdapterError(f"adapter {spec!r}: expected 'package.module:object'")
    obj: object = import_module(module, spec)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AdapterError(f"adapter {spec!r}: module {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    adapter = as_adapter(obj, spec)
    if adapter.name in ("adapter", ""):
        adapter.name = spec
    return adapter
