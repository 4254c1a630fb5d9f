"""Whether a module computes each row of its batch from that row alone, found by probing it
on this process's rows.

The automatic data-parallel path (``data_parallel``) first runs a module through DTensor
and takes the module as row-local when no redistribution was needed. DTensor's layouts
cannot express every row-local computation: ``nn.MultiheadAttention`` returning its
attention weights reshapes its output through a ``(sequence * batch, features)`` view,
with the batch inside the merged dim, and DTensor gathers the whole batch there. For such
a module the probe decides instead:

- the module's forward runs three times on a doubled batch, this process's rows twice
  (``[a, a]``), then with one half's values changed (``[a', a]`` and ``[a, a']``);
- it is row-local when each half's outputs are bitwise the same whatever the other half
  holds, and every output keeps the batch on dim 0.

The three runs use the same shapes, so the same kernels: a row-local computation gives
the same bits for the same row, while a computation that mixes rows (batch statistics,
a sum over the batch, a cumulative sum) changes them. The runs leave no trace: without
gradients, with the random number generator and the module's buffers put back, and with
the automatic path's global hooks set aside (the caller's job; see ``probe``). A forward
that asks for a collective (an annotation inside it, a distributed call) is refused it
before it starts, and is not row-local by the probe: the other processes do not run it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from torchspmd.tree import map_tensors

__all__ = ["probe"]


class _Collective(Exception):
    """A probed forward asked for a collective: refused before it starts."""


class _NoCollectives(TorchFunctionMode):
    """``torch.distributed``'s functions raise instead of running. The probe runs on this
    process's rows, which differ from the others' (an uneven split): a collective there would
    meet the other processes with other sizes, or not at all."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (getattr(func, "__module__", None) or "").startswith("torch.distributed"):
            raise _Collective(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


class _NoCollectiveOps(TorchDispatchMode):
    """The same for collective operators (DTensor's redistributions, functional collectives)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("_c10d_functional", "_c10d_functional_autograd", "c10d"):
            raise _Collective(str(func))
        return func(*args, **(kwargs or {}))


def _changed(t: torch.Tensor) -> torch.Tensor:
    """Rows of the same kind as ``t``'s with other values, still valid inputs: each integer
    becomes the next larger value present in ``t`` (token ids stay token ids, an ignored
    label stays one of the labels present), a mask flips, a float is scaled and shifted.
    Values change rather than move: a permutation of the rows would keep every sum over
    the batch, and hide a computation that mixes rows."""
    if t.dtype == torch.bool:
        return ~t
    if t.is_floating_point() or t.is_complex():
        return t * 0.5 + 0.125
    values = t.unique()  # sorted
    return values[(torch.searchsorted(values, t) + 1) % values.numel()]


def _doubled(args, kwargs, rows: int, which: int):
    """Every tensor with ``rows`` rows doubled on dim 0: both halves this process's rows
    (``which`` 0), or with the first (1) or the second (2) half changed. Returns the inputs
    and whether anything was changed."""
    changed = []

    def double(t):
        if t.dim() == 0 or t.shape[0] != rows:
            return t
        other = _changed(t) if which else t
        if which:
            changed.append(not torch.equal(other, t))
        return torch.cat([other, t] if which == 1 else [t, other])

    doubled_args, doubled_kwargs = map_tensors((args, kwargs), double, lambda v: v)
    return doubled_args, doubled_kwargs, any(changed)


def _outputs(output) -> list[torch.Tensor] | None:
    found: list = []

    def other(v):
        if not (v is None or isinstance(v, (bool, int, float, str))):
            found.append(None)  # an object whose tensors cannot be followed
        return v

    map_tensors(output, lambda t: found.append(t) or t, other)
    return None if not found or any(t is None for t in found) else found


def probe(module: nn.Module, args: tuple, kwargs: dict, rows: int) -> bool:
    """Whether ``module(*args, **kwargs)`` (this process's rows, plain tensors, ``rows`` of
    them on dim 0 of every batch tensor) computes each row from that row alone. The module's
    own hooks are not run: its ``forward`` is called."""
    if rows < 1:
        return False
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    base = None
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), _NoCollectives(), _NoCollectiveOps():
            rng = torch.get_rng_state()
            for which in (0, 1, 2):
                a, k, changed = _doubled(args, kwargs, rows, which)
                if which and not changed:
                    return False  # nothing could be changed: no evidence either way
                torch.set_rng_state(rng)  # the same dropout masks in every run
                outs = _outputs(module.forward(*a, **k))
                if outs is None or any(t.dim() == 0 or t.shape[0] != 2 * rows for t in outs):
                    return False
                if base is None:
                    base = [t.detach().clone() for t in outs]
                    continue
                # the half left as it was (the second when the first changed) keeps its bits
                kept = slice(rows, None) if which == 1 else slice(None, rows)
                if len(outs) != len(base) or not all(torch.equal(b[kept], t[kept]) for b, t in zip(base, outs)):
                    return False
                del outs  # (compared as it comes: at most two runs' outputs held)
    except Exception:  # noqa: BLE001 - a module that cannot take a doubled batch, or that asks for a
        return False  # collective (_Collective), is not proven row-local
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    return True
