"""The ``torchspmd train`` job: config, data, models, loop, checkpoints, export."""

from torchspmd.train.config import PRESETS, TrainConfig, from_args, preset
from torchspmd.train.loop import run as _run

__all__ = ["TrainConfig", "PRESETS", "preset", "from_args", "run"]


def run(cfg: TrainConfig, explain: bool = False) -> dict:
    """Train as ``cfg`` says; with ``explain``, build and shard the model as for training,
    print its layouts and the collectives of one step (``torchspmd explain``), and stop."""

    return _run(cfg, explain=explain)
