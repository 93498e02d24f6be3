"""Models, losses and data sources of your own, reached from a config by import path.

    model:  {factory: vit:build, options: {depth: 12}}     # build(rngs, **options) -> nnx.Module
    train:  {loss: vit:loss}                               # loss(model, batch) -> loss or (loss, metrics)
    data:   {source: vit:batches}                          # batches(step, rows, seed) -> {name: array}

An import path ``package.module:attribute`` is looked up from the config file's folder first, then the
working directory, then ``sys.path``, so an ``examples/vit.yaml`` beside ``examples/vit.py`` says
``vit:build``. A factory that takes a ``remat`` argument receives the config's per-layer
:class:`~shardmem.remat.LayerPlan` (run stacked NNX layers with :func:`shardmem.remat_scan`, Linen
layers with :func:`shardmem.models.linen.remat_layers`).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from shardmem.errors import ConfigError

#: Folders searched before ``sys.path``: the loaded config's folder (set by :func:`search_from`).
_SEARCH: list[str] = []


@contextlib.contextmanager
def search_from(folder: str | Path | None) -> Iterator[None]:
    """Makes import paths resolve from ``folder`` (a config file's folder) while open."""
    if folder is None:
        yield
        return
    _SEARCH.insert(0, str(Path(folder).resolve()))
    try:
        yield
    finally:
        _SEARCH.remove(str(Path(folder).resolve()))


def import_object(path: str, key: str) -> Any:
    """Returns the object an import path ``package.module:attribute`` names; ``key`` is the config key
    it came from, for the message when it cannot be found."""
    module_name, _, attribute = path.partition(":")
    folders = [*_SEARCH, str(Path.cwd())]
    added = [f for f in folders if f not in sys.path]
    sys.path[:0] = added
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise ConfigError(
                f"{key}={path!r}: no module {e.name!r} in {', '.join(dict.fromkeys(folders))} or sys.path; "
                "give a path relative to the config's folder or install the package"
            ) from None
        raise
    finally:
        for folder in added:
            sys.path.remove(folder)
    value: Any = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            public = [n for n in dir(value) if not n.startswith("_")]
            from shardmem.errors import did_you_mean

            raise ConfigError(
                f"{key}={path!r}: {module_name} has no {attribute!r}{did_you_mean(part, public)}"
            )
        value = getattr(value, part)
    if not callable(value):
        raise ConfigError(f"{key}={path!r} is a {type(value).__name__}, not a function")
    return value


def takes(fn: Callable, name: str) -> bool:
    """Whether ``fn`` (a function, or a class through its ``__init__``) names a parameter ``name``."""
    try:
        parameters = inspect.signature(fn.__init__ if inspect.isclass(fn) else fn).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters
