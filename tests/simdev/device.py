"""``torch.simdev``: the device module of the simdev test device (what ``torch.cuda`` is to
CUDA), written over ``torch.accelerator`` and the generic ``torch.Stream``/``torch.Event``."""

from __future__ import annotations

import contextlib

import torch

Stream = torch.Stream
Event = torch.Event


def _index(device=None) -> int:
    if device is None:
        return torch.accelerator.current_device_index()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return torch.accelerator.current_device_index() if device.index is None else device.index


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def _lazy_init() -> None:
    pass


def device_count() -> int:
    from . import extension
    return extension().device_count()


def current_device() -> int:
    return torch.accelerator.current_device_index()


def set_device(device) -> None:
    torch.accelerator.set_device_index(_index(device))


def synchronize(device=None) -> None:
    torch.accelerator.synchronize(device)


def current_stream(device=None):
    return torch.accelerator.current_stream(device)


def default_stream(device=None):
    return torch.accelerator.current_stream(device)


@contextlib.contextmanager
def stream(s):
    if s is None:
        yield
        return
    before = torch.accelerator.current_stream(s.device)
    torch.accelerator.set_stream(s)
    try:
        yield
    finally:
        torch.accelerator.set_stream(before)


def _generator(device=None):
    return default_generators[_index(device)]


def get_rng_state(device="simdev") -> torch.Tensor:
    return _generator(device).get_state()


def set_rng_state(state: torch.Tensor, device="simdev") -> None:
    _generator(device).set_state(state)


def manual_seed(seed: int) -> None:
    _generator().manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for g in default_generators:
        g.manual_seed(int(seed))


def memory_allocated(device=None) -> int:
    from . import extension
    return extension().memory(_index(device))[0]


def max_memory_allocated(device=None) -> int:
    from . import extension
    return extension().memory(_index(device))[1]


def get_device_name(device=None) -> str:
    return "simdev (host memory, CPU kernels)"


#: one generator per device (random kernels run through the CPU fallback and draw from the
#: CPU's generator: these hold the state a program saves and restores for the device)
default_generators = tuple(torch.Generator() for _ in range(8))
