"""``torch_xla.utils.utils`` under ``--xla-compat``: ``SampleGenerator`` and the small pure
helpers programs and torch_xla's tests use (environment flags, ``as_list``, free ports)."""

from __future__ import annotations

import contextlib
import os
import socket

from torchspmd.compat.stand_ins import not_provided


def as_list(t):
    """``t`` if it is a list or tuple, else ``[t]``."""
    return t if isinstance(t, (tuple, list)) else [t]


def getenv_as(name: str, type, defval=None):
    """The environment variable ``name`` converted by ``type`` (a bool from its integer), or
    ``defval`` when it is unset."""
    env = os.environ.get(name)
    if env is None:
        return defval
    return bool(int(env)) if type is bool else type(env)


def check_env_flag(name: str, default: str = "") -> bool:
    """Whether the environment variable ``name`` is ``'true'`` or a positive integer."""
    flag = os.getenv(name, default)
    return flag == "true" or (flag.isdigit() and int(flag) > 0)


def get_free_tcp_ports(n: int = 1) -> list[int]:
    """``n`` TCP ports free on this host now."""
    ports = []
    for _ in range(n):
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
            s.bind(("", 0))
            ports.append(s.getsockname()[1])
    return ports


class SampleGenerator:
    """Yields ``data`` ``sample_count`` times (synthetic data in place of a loader); each
    ``iter()`` starts again."""

    def __init__(self, data, sample_count: int):
        self._data = data
        self._sample_count = int(sample_count)
        self._count = 0

    def __iter__(self):
        return SampleGenerator(self._data, self._sample_count)

    def __len__(self) -> int:
        return self._sample_count

    def __next__(self):
        if self._count >= self._sample_count:
            raise StopIteration
        self._count += 1
        return self._data

    next = __next__


__getattr__ = not_provided("torch_xla.utils.utils")
