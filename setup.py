"""The compiled parts of aiodist's engine, built where Cython and a C compiler are at hand.

Everything else is in pyproject.toml. Each extension is optional: without a compiler, or where
one fails, the install goes on and aiodist runs its Python engine (``aiodist.runtime.native``
says which one a process runs, and why).
"""

from setuptools import Extension, setup

try:
    from Cython.Build import cythonize
except ImportError:  # (a build without Cython: the Python engine only)
    ext_modules = []
else:
    ext_modules = cythonize(
        [Extension("aiodist.transport._shm_ring", ["aiodist/transport/_shm_ring.pyx"], optional=True)],
        language_level=3,
    )

setup(ext_modules=ext_modules)
