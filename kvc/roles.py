"""A node's role in disaggregated serving: settings, scheduler, metrics and wire agree."""

from __future__ import annotations

from typing import Final, Literal

NodeRole = Literal["prefill", "decode", "both"]
NODE_ROLES: Final[tuple[NodeRole, ...]] = ("prefill", "decode", "both")
