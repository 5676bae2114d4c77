"""The compiled parts of aiodist's engine, built where Cython and a C compiler are at hand.

Everything else is in pyproject.toml. A part that cannot be built is skipped with one line
saying why, and the install goes on: aiodist then runs that part's Python twin
(``aiodist.native`` says which engine a process runs; ``AIODIST_NATIVE=1`` insists on
the compiled one).
"""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

PARTS = [
    Extension("aiodist.transport._shm_ring", ["aiodist/transport/_shm_ring.pyx"]),
    Extension("aiodist.transport._matching", ["aiodist/transport/_matching.pyx"]),
    Extension("aiodist.transport._shm_eager", ["aiodist/transport/_shm_eager.pyx"]),
    Extension("aiodist._work", ["aiodist/_work.pyx"]),
]


class OptionalBuildExt(build_ext):
    """Build each part if it can be built; never fail the install for one that cannot."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # (no compiler at all: the Python engine)
            print(
                f"aiodist: the compiled engine is not built ({exc}): the Python engine runs", file=sys.stderr
            )

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"aiodist: {ext.name} is not built ({exc}): its Python twin runs", file=sys.stderr)


try:
    from Cython.Build import cythonize
except ImportError:  # (a build without Cython: the Python engine only)
    print("aiodist: Cython is not installed: the Python engine runs", file=sys.stderr)
    ext_modules = []
else:
    ext_modules = cythonize(PARTS, language_level=3)

setup(ext_modules=ext_modules, cmdclass={"build_ext": OptionalBuildExt})
