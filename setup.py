"""Builds kvtier's compiled modules, ``kvtier._core`` and ``kvtier._rows`` (the rest is in
pyproject.toml).

``pip install -e .`` builds them in place; ``kvtier/_vendor`` holds xxHash's header.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtier._core",
            sources=["kvtier/_core.c"],
            depends=["kvtier/_vendor/xxhash.h"],
            include_dirs=["kvtier/_vendor"],
        ),
        Extension(
            "kvtier._rows",
            sources=["kvtier/_rows.c"],
            depends=["kvtier/_vendor/xxhash.h"],
            include_dirs=["kvtier/_vendor"],
        ),
    ]
)
