"""How what the workers must rebuild reaches them: by import path, derived from the object.

Every process of a run (the coordinator, each worker, agents on other machines) rebuilds
the user's model factory, optimizer and schedule itself, by name. `import_path` derives
that name from a function or class:

- defined at module level of an importable module: `package.module:name`;
- defined in the script being run (`python train.py`, module `__main__`): the script's
  file, `/abs/path/train.py:name` (`python -m pkg.train`: `pkg.train:name`), which the
  workers import as a module, so the script must start its run under
  `if __name__ == "__main__":`;
- anything else (a lambda, a function defined inside another, a notebook cell, an object
  without a name) is refused by `import_path` with one line saying to define it at module
  level in a file; `reference` sends it by value instead (`bamboo.config.objects`:
  cloudpickle, found again by its SHA-256), refusing in one line only what cannot be
  pickled.

Importable without torch.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from bamboo.config import ConfigError

__all__ = ["import_path", "reference", "LOADED_BY_PATH"]

LOADED_BY_PATH = "_bamboo_model_"
"""The prefix of the module name a `FILE.py:NAME` is imported under (bamboo.model.api)."""

_FIX = "define it at module level (def NAME ...) in a .py file, the script itself or a module it imports"


def import_path(obj: Any, what: str) -> str:
    """`MODULE:NAME` or `/path/file.py:NAME` by which every process finds `obj` again;
    ConfigError (one line naming `what`) when no process but this one could."""
    name = getattr(obj, "__qualname__", None)
    module = getattr(obj, "__module__", None)
    if not isinstance(name, str) or not isinstance(module, str):
        raise ConfigError(f"{what}: {_show(obj)} has no importable name: the workers rebuild "
                          f"it by name; {_FIX}", what)
    if name == "<lambda>" or "<" in name or "." in name:
        short = name.rsplit(".", 1)[-1]
        kind = "a lambda" if short == "<lambda>" else \
            f"'{short}', defined inside a function or class,"
        raise ConfigError(f"{what}: {kind} cannot be imported by the workers: {_FIX}", what)
    mod = sys.modules.get(module)
    if mod is None or getattr(mod, name, None) is not obj:
        raise ConfigError(f"{what}: '{name}' is not found as {module}.{name} (redefined or "
                          f"made at run time): {_FIX}", what)
    return f"{_module_target(mod, module, what)}:{name}"


def reference(obj: Any, what: str, *, by_value: bool = False) -> str:
    """What every process finds `obj` again by: its import path when it has one (and not
    `by_value`), else a by-value reference (`bamboo.config.objects.send`); ConfigError
    (one line naming `what`) for an object that cannot be pickled."""
    if not by_value:
        try:
            return import_path(obj, what)
        except ConfigError:
            pass
    from bamboo.config import objects
    return objects.send(obj, what)


def _module_target(mod: Any, module: str, what: str) -> str:
    """The importable name of module `mod`: its own, or its file for a script."""
    if module != "__main__" and not module.startswith(LOADED_BY_PATH):
        return module
    spec = getattr(mod, "__spec__", None)
    if module == "__main__" and spec is not None and spec.name and spec.name != "__main__" \
            and not spec.name.startswith(LOADED_BY_PATH):
        return spec.name  # `python -m package.script`
    file = getattr(mod, "__file__", None)
    if not isinstance(file, str) or not file.endswith(".py") or not Path(file).is_file():
        raise ConfigError(f"{what}: defined in an interactive session or a notebook, which the "
                          f"workers cannot import: put it in a .py file and import it from there "
                          f"(or {_FIX})", what)
    return str(Path(file).resolve())


def _show(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 60 else text[:57] + "..."
