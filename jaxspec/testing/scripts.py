"""`load_script(name)`: a module of the checkout's scripts/ (not a package), for in-process
runs of a script's `main` or its helpers."""

import functools
import importlib.util
import types

from jaxspec.testing import ROOT


@functools.cache
def load_script(name: str) -> types.ModuleType:
    """scripts/{name}.py executed as a module named `name`, once per process (every caller
    gets the same module object, so a monkeypatch on it is seen by all)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
