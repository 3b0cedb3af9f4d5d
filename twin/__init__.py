"""mixfleet.twin: the simulated world. A SimPy discrete-event model of samplers, router, autoscaler,
trainer and weight sync, and the twin check the mix planner (mixfleet.planner, below) is handed to verify its
best candidates (checks.py). Never imports torch or mixfleet.runner.

Its hot path, twin/core.py, is compiled at install (setup.py) where a C compiler is there. Here the plain Python
source is used instead of the compiled module when MIXFLEET_PURE_PYTHON is set (tests compare the two), or when
the source is newer than the compiled module (edited since the install: a warning says to re-install).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import warnings
from pathlib import Path


def _use_source_core() -> None:
    here = Path(__file__).resolve().parent
    source = here / "core.py"
    built = [p for p in here.iterdir() if p.name.startswith("core.") and p.suffix in (".so", ".pyd")]
    pure = os.environ.get("MIXFLEET_PURE_PYTHON", "") not in ("", "0")
    if not built or not source.is_file():
        return  # nothing compiled: the import system finds core.py itself
    stale = source.stat().st_mtime > max(p.stat().st_mtime for p in built)
    if not (pure or stale):
        return
    if stale and not pure:
        warnings.warn(f"{source} changed after it was compiled ({built[0].name}); running it as Python (slower). "
                      "Re-install (pip install -e .) to compile it again.", RuntimeWarning, stacklevel=3)
    name = f"{__name__}.core"
    spec = importlib.util.spec_from_file_location(name, source,
                                                  loader=importlib.machinery.SourceFileLoader(name, str(source)))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


_use_source_core()
