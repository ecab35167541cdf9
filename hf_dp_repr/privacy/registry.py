"""The name → entry tables of the privacy registries (clippers, clipping modes, reductions): one way to add an entry
and one way to look one up, each refusing with the names it knows.

    >>> from hf_dp_repr.privacy.registry import add_entry, entry
    >>> table = {}
    >>> add_entry(table, "colour", "red", 1)
    >>> entry(table, "colour", "red")
    1
    >>> entry(table, "colour", "blue")
    Traceback (most recent call last):
    hf_dp_repr.errors.ArgumentError: unknown colour 'blue'; use one of ('red',).
"""

from __future__ import annotations

from ..errors import ArgumentError


def add_entry(table: dict, kind: str, name: str, value) -> None:
    """Register `value` under `name`; a name registered twice is refused (the first would be shadowed silently)."""
    if name in table:
        raise ArgumentError(f"{kind} {name!r} is already registered.")
    table[name] = value


def entry(table: dict, kind: str, name: str):
    """The entry registered under `name`, or ArgumentError listing the registered names."""
    if name not in table:
        raise ArgumentError(f"unknown {kind} {name!r}; use one of {tuple(table)}.")
    return table[name]
