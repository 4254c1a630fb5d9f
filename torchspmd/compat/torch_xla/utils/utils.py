"""``torch_xla.utils.utils`` under ``--xla-compat``: ``SampleGenerator``."""

from __future__ import annotations

from torchspmd.compat.stand_ins import not_provided


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
