"""Command-line flags derived from a pydantic-settings model.

Every field of a settings class becomes ``--field-name`` with the field's
description as help, so ``kvc conductor --help`` and ``kvc agent --help`` list
every setting and its environment variable. Precedence: flag > environment >
default. Validation errors surface as one readable message (fail fast).
"""

from __future__ import annotations

import argparse
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

S = TypeVar("S", bound=BaseSettings)


def add_settings_arguments(
    parser: argparse.ArgumentParser, settings_cls: type[BaseSettings]
) -> None:
    prefix = str(settings_cls.model_config.get("env_prefix", ""))
    for name, field in settings_cls.model_fields.items():
        default = field.default if field.default_factory is None else "(computed)"
        env = f"{prefix}{name}".upper()
        help_text = f"{field.description or ''} [env {env}; default: {default}]"
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=None,
            metavar=name.upper(),
            help=help_text.strip(),
        )


class SettingsError(Exception):
    """Configuration is invalid; the message says which setting and why."""


def settings_from_args(settings_cls: type[S], ns: argparse.Namespace) -> S:
    overrides: dict[str, Any] = {
        name: value
        for name in settings_cls.model_fields
        if (value := getattr(ns, name, None)) is not None
    }
    try:
        return settings_cls(**overrides)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "settings"
            lines.append(f"  --{loc.replace('_', '-')}: {err['msg']}")
        raise SettingsError("invalid configuration:\n" + "\n".join(lines)) from exc
