"""One way to register and look up a named entry, for every registry of the package (clippers, clipping modes,
reductions, accountants, ghost and per-sample rules, search backends, scope groups and block selectors).

A `Registry` is a dict (name → entry, in registration order: the order messages list the names and "auto" tries
them) that refuses a name registered twice unless `replace=True` (the first would be shadowed silently) and whose
lookups name the registered entries. Code that offers the names as choices reads the registry when it is used
(`Choices`), so an entry registered after that code was imported is accepted.

    >>> from hf_dp_repr.registry import Choices, Registry
    >>> colours = Registry("colour")
    >>> colours.add("red", 1)
    1
    >>> colours.add("red", 2)
    Traceback (most recent call last):
    hf_dp_repr.errors.ArgumentError: colour 'red' is already registered; pass replace=True to replace it.
    >>> colours.add("red", 2, replace=True), colours.lookup("red")
    (2, 2)
    >>> colours.lookup("blue")
    Traceback (most recent call last):
    hf_dp_repr.errors.ArgumentError: unknown colour 'blue'; use one of ('red',).
    >>> choices = Choices("auto", registry=colours)
    >>> _ = colours.add("blue", 3)  # registered after `choices` was made: a choice too
    >>> "blue" in choices, tuple(choices)
    (True, ('auto', 'red', 'blue'))
"""

from __future__ import annotations

from .errors import ArgumentError


class Registry(dict):
    """name → entry, in registration order. `kind` names the entries in messages; `error` is what a duplicate or an
    unknown name raises (a subclass of ArgumentError, e.g. DPConfigError)."""

    def __init__(self, kind: str, error: type[Exception] = ArgumentError):
        super().__init__()
        self.kind, self.error = kind, error

    def add(self, name, value, *, replace: bool = False):
        """Register `value` under `name` and return it; a name already registered is refused unless `replace`."""
        if name in self and not replace:
            raise self.error(f"{self.kind} {_label(name)} is already registered; pass replace=True to replace it.")
        self[name] = value
        return value

    def lookup(self, name):
        """The entry registered under `name`, or `error` listing the registered names."""
        if name not in self:
            raise self.error(f"unknown {self.kind} {_label(name)}; use one of {tuple(map(_label_plain, self))}.")
        return self[name]

    def __copy__(self):
        copy = Registry(self.kind, self.error)
        copy.update(self)
        return copy


def _label(name) -> str:
    return name.__name__ if isinstance(name, type) else repr(name)


def _label_plain(name):
    return name.__name__ if isinstance(name, type) else name


class Choices:
    """The names a registry offers, after fixed ones (e.g. "auto"), read each time they are used: argparse choices
    and argument checks that accept an entry registered after the arguments module was imported."""

    def __init__(self, *fixed: str, registry: dict):
        self.fixed, self.registry = fixed, registry

    def __contains__(self, name) -> bool:
        return name in self.fixed or name in self.registry

    def __iter__(self):
        yield from self.fixed
        yield from self.registry

    def __repr__(self) -> str:
        return repr(tuple(self))
