"""The ``torchspmd train`` job: config, data, models, loop, checkpoints, export."""

from torchspmd.train.config import PRESETS, TrainConfig, from_args, preset

__all__ = ["TrainConfig", "PRESETS", "preset", "from_args", "run"]


def run(cfg: TrainConfig) -> dict:
    from torchspmd.train.loop import run as _run

    return _run(cfg)
