"""The test suite."""

import kvc  # noqa: F401  (first: gRPC's fork handlers off, see kvc/__init__.py)
