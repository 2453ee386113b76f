"""The one compiled module; everything else about the package is in pyproject.toml.

``kvc._native`` holds two loops of the request path in C: the chained block keys of
``kvc/block_keys.py`` and the shadow prefix index's key lookup. It is optional: where no
C compiler is found the install still succeeds (setuptools prints why the module was
skipped) and the Python twins compute the same results (``kvc/native.py``).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvc._native", sources=["kvc/_native.c"], optional=True)])
