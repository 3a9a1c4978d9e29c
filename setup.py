"""Build the mooncaked._native Cython extension; metadata lives in pyproject.toml."""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [Extension("mooncaked._native", ["_native/_native.pyx"], extra_compile_args=["-O2"],
                   libraries=["numa", "uring"])],
        compiler_directives={"language_level": 3, "boundscheck": False, "wraparound": False},
        include_path=["_native"],
    )
)
