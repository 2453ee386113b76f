"""The installed package's version, as every service reports it."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["package_version"]


def package_version() -> str:
    """``kv-conductor``'s installed version; ``0+unknown`` when run from a bare checkout."""
    try:
        return version("kv-conductor")
    except PackageNotFoundError:
        return "0+unknown"
