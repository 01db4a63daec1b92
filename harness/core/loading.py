"""A user's object by name, ``"package.module:attr"`` (their models, optimizers, adapters), and the one line an
error in their code becomes."""

from __future__ import annotations

import importlib


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and its message with the line breaks taken out."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def resolve(name: str, what: str, error: type[ValueError]) -> tuple[object, str]:
    """(the object ``"package.module:attr"`` names, attr); `error` with one line naming the `what` ("model",
    "optimizer") when the name is malformed, the module does not import or has no such attribute."""
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise error(f"{what} {name!r}: expected 'package.module:factory'")
    try:
        obj: object = importlib.import_module(module)
    except Exception as exc:  # ImportError, SyntaxError, anything its top level raises
        raise error(f"{what} {name!r}: module {module!r} could not be imported: {one_line(exc)}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(f"{what} {name!r}: module {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj, attr
