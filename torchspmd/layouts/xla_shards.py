"""torch_xla's types for one device's part of a sharded tensor: ``ShardingType`` and
``XLAShard`` (what ``XLAShardedTensor.local_shards`` holds), engine-neutral values."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import List, Union

import torch

__all__ = ["ShardingType", "XLAShard"]


class ShardingType(IntEnum):
    """torch_xla's ``ShardingType`` (XLA's ``OpSharding.Type`` numbers)."""
    REPLICATED = 0
    MAXIMAL = 1
    TUPLE = 2
    TILED = 3
    MANUAL = 4
    PARTIAL = 5
    UNKNOWN = 6


@dataclass
class XLAShard:
    """One device's shard: ``data`` (padded to the tile size), its ``indices`` into the global
    tensor (without padding; ``Ellipsis`` when replicated), ``shard_device`` and
    ``replica_id``, as torch_xla's."""
    data: torch.Tensor
    indices: Union[type(Ellipsis), List[slice]]
    shard_device: str
    replica_id: int

    @property
    def unpadded_data(self) -> torch.Tensor:
        if self.indices is Ellipsis:
            return self.data
        return self.data[tuple(slice(0, s.stop - s.start) for s in self.indices)]

    @unpadded_data.setter
    def unpadded_data(self, t: torch.Tensor) -> None:
        if self.indices is Ellipsis:
            self.data[...] = t
        else:
            self.data[tuple(slice(0, s.stop - s.start) for s in self.indices)] = t
