"""Input validation shared by the analyzers: float64 tensors, and errors that name the argument and the fix."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import ArgumentTypeError, DataError


def as_float64_matrix(x: Any, name: str = "features") -> torch.Tensor:
    """`x` (n × d array or tensor) as a float64 tensor, on its own device (CPU for numpy; MPS has no float64)."""
    if isinstance(x, torch.Tensor):
        t = x.detach()
        if t.device.type == "mps":
            t = t.cpu()
        t = t.to(torch.float64)
    else:
        try:
            t = torch.as_tensor(np.asarray(x, dtype=np.float64))
        except (TypeError, ValueError) as err:
            raise ArgumentTypeError(f"`{name}` must be a numeric n × d array or tensor, got "
                                    f"{type(x).__name__}") from err
    if t.ndim == 1:
        raise DataError(f"`{name}` must be 2-D (n examples × d dims), got shape {tuple(t.shape)}; "
                        f"for a single feature pass `{name}.reshape(-1, 1)`")
    if t.ndim != 2:
        raise DataError(f"`{name}` must be 2-D (n examples × d dims), got shape {tuple(t.shape)}; "
                        f"flatten or pool the extra dimensions first")
    if t.shape[0] == 0 or t.shape[1] == 0:
        raise DataError(f"`{name}` is empty (shape {tuple(t.shape)}); pass at least one example with one dim")
    if not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).any(dim=1).sum())
        raise DataError(f"`{name}` has non-finite values (NaN or inf) in {bad} row(s); "
                        f"drop those rows or fix the model producing them (e.g. fp16 overflow)")
    return t


def as_int_labels(y: Any, n: int, name: str = "labels", device: torch.device | None = None) -> torch.Tensor:
    """`y` as a 1-D int64 tensor of length `n` on `device`."""
    t = y.detach() if isinstance(y, torch.Tensor) else torch.as_tensor(np.asarray(y))
    if t.ndim != 1:
        raise DataError(f"`{name}` must be 1-D (one integer class per example), got shape {tuple(t.shape)}; "
                        f"for one-hot labels pass `{name}.argmax(1)`")
    if t.is_floating_point():
        if not bool((t == t.round()).all()):
            raise DataError(f"`{name}` must hold integer class ids, got non-integer floats")
    elif t.dtype == torch.bool or t.is_complex():
        raise DataError(f"`{name}` must hold integer class ids, got dtype {t.dtype}")
    if t.shape[0] != n:
        raise DataError(f"`features` has {n} rows but `{name}` has {t.shape[0]}; pass one {name[:-1]} per row")
    return t.to(device=device, dtype=torch.int64)


def as_float64_targets(y: Any, n: int, name: str = "targets", device: torch.device | None = None) -> torch.Tensor:
    """`y` (n or n × q) as a float64 n × q tensor on `device`."""
    t = y.detach() if isinstance(y, torch.Tensor) else torch.as_tensor(np.asarray(y, dtype=np.float64))
    t = t.to(device=device, dtype=torch.float64)
    if t.ndim == 1:
        t = t[:, None]
    if t.ndim != 2:
        raise DataError(f"`{name}` must be 1-D (scalar target) or 2-D (n × outputs), got shape {tuple(t.shape)}")
    if t.shape[0] != n:
        raise DataError(f"`features` has {n} rows but `{name}` has {t.shape[0]}; pass one target per row")
    if not bool(torch.isfinite(t).all()):
        raise DataError(f"`{name}` has non-finite values (NaN or inf); drop those rows")
    return t


def input_eps(x: Any) -> float:
    """Machine epsilon of the precision `x` was computed in (float32 features carry float32 rounding)."""
    dtype = x.dtype if isinstance(x, torch.Tensor) else getattr(np.asarray(x), "dtype", None)
    if isinstance(dtype, torch.dtype):
        return torch.finfo(dtype).eps if dtype.is_floating_point else float(np.finfo(np.float64).eps)
    if dtype is not None and np.issubdtype(dtype, np.floating):
        return float(np.finfo(dtype).eps)
    return float(np.finfo(np.float64).eps)
