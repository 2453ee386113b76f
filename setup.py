"""The one compiled module; everything else about the package is in pyproject.toml.

``kvc._native`` holds loops of the request path in C: the chained block keys of
``kvc/block_keys.py``, the shadow prefix index's key lookup and the output-length
model's Kaplan-Meier rebuild. Floating point is not contracted (``-ffp-contract=off``): a
fused multiply-add would round once where the Python twin rounds twice, and the tests
hold the two to the same bits. It is optional: where no
C compiler is found the install still succeeds (setuptools prints why the module was
skipped) and the Python twins compute the same results (``kvc/native.py``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvc._native",
            sources=["kvc/_native.c"],
            extra_compile_args=["-ffp-contract=off"],
            optional=True,
        )
    ]
)
