"""The registry of privacy accountants: one entry per name, with the neighbouring relations it computes.

An accountant is a function `epsilon(history, delta, neighboring) -> float`: the ε that a history of DP-SGD phases
((σ, q, steps), ..., merged, every σ > 0 and steps > 0) spends at δ, for `neighboring` neighbours. It must be an
upper bound of the true ε. `accounting.compute_epsilon` (and through it calibration, floors, the ledger, the card)
looks accountants up here; `DPTrainingArguments(accountant=...)`, `hf-dp-repr privacy --accountant` and every error
message list the names registered here. `REFUSED` holds names refused with a reason (Opacus' `gdp`).

Built in: dp_accounting's `pld` (privacy loss distributions; add/remove and replace-one) and Opacus' `prv` and `rdp`
(add/remove only), checked by tests/test_accounting.py against dp_accounting on a range of histories. Adding one is
one registration; `register_accountant` refuses a function that reports less than a lower bound of the true ε
(dp_accounting's optimistic PLD) on `REFERENCE_HISTORIES`, as Opacus' `gdp` would.

Example (Opacus' RDP analysis on a finer grid of orders: a tighter ε, still an upper bound):
    >>> from opacus.accountants import RDPAccountant
    >>> from hf_dp_repr.privacy.accounting import compute_epsilon
    >>> @register_accountant("rdp_fine", neighboring=("add_remove",), source="Opacus")
    ... def rdp_fine(history, delta, neighboring):
    ...     acc = RDPAccountant()
    ...     acc.history = list(history)
    ...     return acc.get_epsilon(delta, alphas=[1 + x / 100 for x in range(1, 1000)] + list(range(11, 257)))
    >>> fine = compute_epsilon([(1.0, 0.01, 1000)], 1e-5, "rdp_fine")
    >>> fine < compute_epsilon([(1.0, 0.01, 1000)], 1e-5, "rdp")
    True
    >>> "rdp_fine" in ACCOUNTANTS  # DPTrainingArguments(accountant="rdp_fine") and the CLI now take it
    True
    >>> del ACCOUNTANTS["rdp_fine"]  # registrations last for the process: this example removes its own
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import DPConfigError
from ..quiet import RDP_LARGEST_ALPHA
from ..registry import Registry
from .attack_rates import gaussian_pld, pld_discretization

History = list[tuple[float, float, int]]  # (noise_multiplier, sample_rate, steps), as Opacus stores it
NEIGHBORING_RELATIONS = ("add_remove", "replace_one")
GDP_REFUSED = ("the 'gdp' accountant is refused: its central-limit approximation is not an upper bound and "
               "under-reports ε for DP-SGD (e.g. 0.47 for a true 1.69 at σ=0.9, q=0.05, 3 steps). Use 'pld' "
               "(default), 'prv' or 'rdp'.")
REFUSED = {"gdp": GDP_REFUSED}  # name: why it is refused
# PLD_DISCRETIZATION (attack_rates.py; coarser for a tiny σ, finer for a tiny q/σ: `pld_discretization`):
# dp_accounting's privacy-loss grid for `pld`. Its pessimistic estimate rounds every loss up to the grid, so a coarser
# grid only raises ε: 1e-3 reports at most ~0.1 % above dp_accounting's finer default (1e-4) and calibrates 5-10×
# faster (measured on histories of 3 to 1000 steps; tests/test_accounting.py checks it is never below), where one
# step's losses (~q/σ) are not far below the grid.
# What a new accountant is checked on: GDP's counter-example (0.47 reported, 1.69 true) and two phases.
REFERENCE_HISTORIES = (((0.9, 0.05, 3),), ((1.0, 0.1, 5), (2.0, 0.2, 3)))
REFERENCE_DELTA = 1e-5


@dataclass(frozen=True)
class Accountant:
    name: str
    epsilon: Callable[[tuple, float, str], float]  # (history, delta, neighboring) -> ε, an upper bound
    neighboring: tuple[str, ...]  # the relations it computes
    source: str  # who computes it (messages, the model card): "dp_accounting", "Opacus", ...


ACCOUNTANTS = Registry("accountant", DPConfigError)  # in registration order: messages list them so


def register_accountant(name: str, neighboring=("add_remove",), source: str = "user", *, replace: bool = False):
    """Decorator: register `epsilon(history, delta, neighboring) -> float` as accountant `name`, for the relations in
    `neighboring`. Refused (DPConfigError) if it reports less than a lower bound of the true ε on
    `REFERENCE_HISTORIES` (dp_accounting's optimistic privacy loss distribution, which rounds every loss down)."""
    def register(epsilon):
        entry = _entry(name, epsilon, neighboring, source)
        if name in ACCOUNTANTS and not replace:  # before the reference check: refused whatever it reports
            ACCOUNTANTS.add(name, entry)
        for relation in entry.neighboring:
            for history in REFERENCE_HISTORIES:
                reported = float(epsilon(history, REFERENCE_DELTA, relation))
                floor = _lower_bound(history, relation)
                if not reported >= floor:
                    raise DPConfigError(
                        f"register_accountant({name!r}): ε = {reported:.4g} for {list(history)} (σ, q, steps) at "
                        f"δ={REFERENCE_DELTA:g}, {relation} neighbours, is below {floor:.4g}, a lower bound of the "
                        "true ε (dp_accounting's optimistic PLD): not an upper bound, refused.")
        ACCOUNTANTS.add(name, entry, replace=replace)
        return epsilon

    return register


def _entry(name: str, epsilon, neighboring, source: str) -> Accountant:
    if name in REFUSED:
        raise DPConfigError(f"register_accountant({name!r}): {REFUSED[name]}")
    neighboring = (neighboring,) if isinstance(neighboring, str) else tuple(neighboring)
    if not neighboring or any(r not in NEIGHBORING_RELATIONS for r in neighboring):
        raise DPConfigError(f"register_accountant({name!r}): neighboring={neighboring}; give one or more of "
                            f"{NEIGHBORING_RELATIONS}.")
    return Accountant(name, epsilon, neighboring, source)


def check_accountant(accountant: str, neighboring: str = "add_remove") -> None:
    """Raise `ValueError` naming the fix unless (accountant, neighbouring relation) is one this library reports."""
    if accountant in REFUSED:
        raise DPConfigError(REFUSED[accountant])
    entry = ACCOUNTANTS.lookup(accountant)
    if neighboring not in NEIGHBORING_RELATIONS:
        raise DPConfigError(f"unknown neighbouring relation {neighboring!r}; use one of {NEIGHBORING_RELATIONS}.")
    if neighboring not in entry.neighboring:
        able = " or ".join(f"{a.name!r} ({a.source})" for a in ACCOUNTANTS.values() if neighboring in a.neighboring)
        raise DPConfigError(f"neighboring={neighboring!r} needs accountant={able}; the {accountant!r} accountant "
                            f"({entry.source}) covers {' and '.join(_words(r) for r in entry.neighboring)} neighbours "
                            "only.")


def accountants_for(neighboring: str) -> tuple[str, ...]:
    """The names of the accountants that compute ε for `neighboring` neighbours, in registration order."""
    return tuple(name for name, a in ACCOUNTANTS.items() if neighboring in a.neighboring)


def default_neighboring(accountant: str) -> str:
    """The relation a run with `accountant` reports when none is given: replace-one where the accountant computes
    it (the ledger and the card publish n), else add/remove."""
    entry = ACCOUNTANTS.get(accountant)
    return "replace_one" if entry is not None and "replace_one" in entry.neighboring else "add_remove"


def _words(relation: str) -> str:
    return relation.replace("_", "/") if relation == "add_remove" else relation.replace("_", "-")


@functools.lru_cache(maxsize=16)
def _lower_bound(history: tuple, neighboring: str) -> float:
    """A lower bound of the true ε: dp_accounting's privacy loss distribution with its optimistic rounding."""
    return float(gaussian_pld(history, neighboring, pessimistic=False).get_epsilon_for_delta(REFERENCE_DELTA))


# ---- the built-in accountants (their checks: tests/test_accounting.py, against dp_accounting) ------------------
def _opacus_epsilon(mechanism: str, history: tuple, delta: float, neighboring: str) -> float:
    from opacus.accountants import create_accountant  # here: importing Opacus imports torch (`pld` needs neither)

    acc = create_accountant(mechanism=mechanism)
    acc.history = [tuple(h) for h in history]
    with _full_batch(history), warnings.catch_warnings():
        # An RDP remark that asks for nothing here (quiet.py): PRV only bounds its domain with RDP; under 'rdp' the
        # order grid is Opacus' own and the ε reported stays an upper bound ('prv', the default, is tighter).
        warnings.filterwarnings("ignore", message=RDP_LARGEST_ALPHA, category=UserWarning)
        return float(acc.get_epsilon(delta=delta))


def _pld_epsilon(history: tuple, delta: float, neighboring: str) -> float:
    import dp_accounting
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    relation = dp_accounting.NeighboringRelation
    acc = PLDAccountant(relation.REPLACE_ONE if neighboring == "replace_one" else relation.ADD_OR_REMOVE_ONE,
                        value_discretization_interval=pld_discretization(history))
    for sigma, q, steps in history:
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return float(acc.get_epsilon(delta))


def _full_batch(history: History):
    """q = 1 (every example in every batch: no amplification by sampling) is exact in Opacus' accountants, but
    the PRV one evaluates log(1 - q) = -inf on a branch it then discards, with a RuntimeWarning: silence that."""
    return np.errstate(divide="ignore") if any(q == 1 for _, q, _ in history) else contextlib.nullcontext()


# Registered without the reference check (it would import dp_accounting and cost a third of a second at every import;
# the tests check more histories); the order is the one messages list them in.
for _name in ("prv", "rdp"):
    ACCOUNTANTS.add(_name, _entry(_name, functools.partial(_opacus_epsilon, _name), ("add_remove",), "Opacus"))
ACCOUNTANTS.add("pld", _entry("pld", _pld_epsilon, NEIGHBORING_RELATIONS, "dp_accounting"))
