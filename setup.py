"""Build hook (the project's metadata is in pyproject.toml): compile the twin's hot path, twin/core.py.

twin/core.py is written in Cython's pure-Python mode, so it is plain Python that Cython can also compile to a C
extension (about 3x faster dry runs). The extension is optional: without a C compiler, or with
MIXFLEET_PURE_PYTHON=1 set at install time, the build goes on and the same module runs as Python, with the same
results (tests/test_twin_compiled.py). `python -c "import mixfleet.twin.core as c; print(c.COMPILED)"` says which.
"""

from __future__ import annotations

import os

from setuptools import Extension, setup


def ext_modules() -> list[Extension]:
    if os.environ.get("MIXFLEET_PURE_PYTHON", "") not in ("", "0"):
        return []
    from Cython.Build import cythonize  # a build requirement (pyproject.toml [build-system])

    ext = Extension("mixfleet.twin.core", ["twin/core.py"], optional=True)  # a failed compile is a warning
    return cythonize([ext], compiler_directives={"language_level": 3}, quiet=True)


setup(ext_modules=ext_modules())
