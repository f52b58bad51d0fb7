# cffi's `cffi_modules` keyword has no pyproject.toml spelling; everything else lives there.
from setuptools import setup

setup(
    cffi_modules=[
        "cffi_build/build_perfcore.py:ffibuilder",
        "cffi_build/build_unwcore.py:ffibuilder",
    ]
)
