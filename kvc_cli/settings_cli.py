"""A settings model on the command line, by pydantic-settings' own CLI source.

The ``kvc`` command tree is argparse (``demo``, ``probe`` and ``bench replay`` are not
settings); on a subcommand's parser, :class:`SettingsCommand` lets a
``CliSettingsSource`` add one option per field of a settings model:

- kebab-case names (``block_size`` → ``--block-size``);
- ``--flag`` / ``--no-flag`` for booleans;
- the choices of ``Literal`` fields, the default and the environment variable in ``--help``;
- a field's ``json_schema_extra={"group": "…"}`` (:data:`GROUP_KEY`) names its section of
  ``--help`` and of docs/configuration.md.

Precedence: flag > environment > default. An invalid value, wherever it came from,
surfaces as one :class:`InvalidSettings` naming the flag and the environment variable.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, CliSettingsSource
from pydantic_settings import SettingsError as CliParseError

S = TypeVar("S", bound=BaseSettings)

GROUP_KEY = "group"
"""Key of a field's ``json_schema_extra`` naming its section of ``--help``."""


class InvalidSettings(Exception):
    """Configuration is invalid; the message says which setting and why."""


@dataclass(frozen=True, slots=True)
class SettingsOption:
    """One setting as the command line shows it (docs/configuration.md is made of these)."""

    name: str
    flags: tuple[str, ...]
    value: str | None  # as --help shows it: {a,b} (choices), int, Path; None: a switch
    env_vars: tuple[str, ...]
    group: str | None
    field: FieldInfo


def settings_group(field: FieldInfo) -> str | None:
    extra = field.json_schema_extra
    group = extra.get(GROUP_KEY) if isinstance(extra, dict) else None
    return group if isinstance(group, str) else None


class SettingsCommand(Generic[S]):
    """The options of one settings model on an argparse parser, and their validation."""

    def __init__(self, parser: argparse.ArgumentParser, settings_cls: type[S]) -> None:
        self.settings_cls = settings_cls
        self._groups: dict[str, argparse._ArgumentGroup] = {}
        self._flags: dict[str, tuple[str, ...]] = {}
        self._values: dict[str, str | None] = {}
        self._source = CliSettingsSource[argparse.ArgumentParser](
            settings_cls,
            root_parser=parser,
            cli_kebab_case=True,
            cli_implicit_flags=True,
            cli_hide_none_type=True,
            cli_show_env_vars=True,
            add_argument_method=self._add_argument,
        )

    def _add_argument(
        self, parser: argparse.ArgumentParser, *flags: str, **kwargs: Any
    ) -> argparse.Action:
        """The source's ``add_argument``: records the flags, files the option in its group."""
        dest: str = kwargs["dest"]
        title = settings_group(self.settings_cls.model_fields[dest])
        if title is None:
            action = parser.add_argument(*flags, **kwargs)
        else:
            if title not in self._groups:
                self._groups[title] = parser.add_argument_group(title)
            action = self._groups[title].add_argument(*flags, **kwargs)
        self._flags[dest] = tuple(action.option_strings)  # with --no-… of a switch
        self._values[dest] = kwargs.get("metavar")
        return action

    @property
    def options(self) -> list[SettingsOption]:
        env_vars = self._source.env_var_names
        return [
            SettingsOption(
                name=name,
                flags=self._flags[name],
                value=self._values[name],
                env_vars=env_vars.get(name, ()),
                group=settings_group(field),
                field=field,
            )
            for name, field in self.settings_cls.model_fields.items()
        ]

    def load(self, ns: argparse.Namespace) -> S:
        """Settings from the parsed flags, then the environment, then the defaults."""
        try:
            return self.settings_cls(_cli_settings_source=self._source(parsed_args=ns))
        except CliParseError as exc:
            raise InvalidSettings(f"invalid configuration:\n  {exc}") from exc
        except ValidationError as exc:
            lines = [f"  {self._where(err['loc'])}{err['msg']}" for err in exc.errors()]
            raise InvalidSettings("invalid configuration:\n" + "\n".join(lines)) from exc

    def _where(self, loc: tuple[int | str, ...]) -> str:
        name = str(loc[0]) if loc else ""
        if name not in self._flags:
            return ""
        env = self._source.env_var_names.get(name, ())
        return f"{self._flags[name][0]}{f' ({env[0]})' if env else ''}: "


def settings_from_args(settings_cls: type[S], ns: argparse.Namespace) -> S:
    """The ``settings_cls`` of the subcommand ``ns`` was parsed for (flags, env, defaults)."""
    command: SettingsCommand[S] = ns.settings_command
    if command.settings_cls is not settings_cls:
        raise TypeError(f"kvc {ns.command} has {command.settings_cls.__name__} settings")
    return command.load(ns)
