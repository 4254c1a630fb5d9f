"""Hand public calls to the XLA backend when ``use_spmd()`` chose it.

``on_xla`` decorates a public function: on the XLA backend the call goes to the function
of the same name in ``torchspmd.backends.xla``. ``OnXla`` is the metaclass of the public
classes (``Mesh``, ``ShardingSpec``, ``MpDeviceLoader``, ``FSDPv2``): constructing one on
the XLA backend builds torch_xla's object instead, and ``isinstance`` accepts it.
"""

from __future__ import annotations

import functools
import sys

from torchspmd import runtime


def xla_active() -> bool:
    return runtime._STATE.backend == "xla"


def on_xla(fn):
    name = fn.__name__

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if runtime._STATE.backend == "xla":
            from torchspmd.backends import xla

            return getattr(xla, name)(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


class OnXla(type):
    """Metaclass: ``cls(...)`` builds torch_xla's counterpart on the XLA backend."""

    def __call__(cls, *args, **kwargs):
        if runtime._STATE.backend == "xla" and "_xla_factory" in cls.__dict__:
            from torchspmd.backends import xla

            return getattr(xla, cls.__dict__["_xla_factory"])(cls, *args, **kwargs)
        return super().__call__(*args, **kwargs)

    def __instancecheck__(cls, obj) -> bool:
        if type.__instancecheck__(cls, obj):
            return True
        xla = sys.modules.get("torchspmd.backends.xla")
        if xla is None or "_xla_factory" not in cls.__dict__:
            return False
        counterpart = xla.counterpart(cls.__dict__["_xla_factory"])
        return counterpart is not None and isinstance(obj, counterpart)
