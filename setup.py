"""Builds kvtier's compiled core, ``kvtier._core`` (the rest is in pyproject.toml).

``pip install -e .`` builds it in place; ``kvtier/_vendor`` holds xxHash's header.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtier._core",
            sources=["kvtier/_core.c"],
            depends=["kvtier/_vendor/xxhash.h"],
            include_dirs=["kvtier/_vendor"],
        )
    ]
)
