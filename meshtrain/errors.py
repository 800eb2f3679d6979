"""Typed errors. Every message names what to change; the CLI prints them without a traceback."""

from __future__ import annotations


class MeshtrainError(Exception):
    """Base class: bad input that the user can fix. The CLI turns it into `error: ...`, exit 2."""


class MeshError(MeshtrainError):
    """A `MeshSpec` cannot be built on the given devices (sizes, names, device count)."""


class RulesError(MeshtrainError):
    """Logical axes cannot be mapped onto the mesh (unknown name, axis reused, indivisible dim)."""


class RecipeError(MeshtrainError):
    """A recipe or strategy composition is invalid (unknown name, conflicting strategies, bad file)."""


class PlanError(MeshtrainError):
    """A sharding plan violates a guard (e.g. too many parameter bytes left replicated)."""


class ConfigError(MeshtrainError):
    """A model, data or training setting is out of range (batch size, sequence length, paths)."""
