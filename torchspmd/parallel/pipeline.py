"""``pipeline``: a model split into stages along a mesh axis (pipeline parallelism).

``runner = ts.pipeline(model, split=DecoderLayer, microbatches=4)`` cuts the model at layer
boundaries into one stage per process of the mesh's ``'pipeline'`` axis, balanced by parameter
count, and returns a runner that owns the training step::

    optimizer = torch.optim.AdamW(runner.parameters(), lr=1e-3)   # this process's stages
    loss = runner.step(inputs, targets, loss_fn)                  # forward and backward
    optimizer.step(); optimizer.zero_grad()

``step`` takes the global batch (every process gives the same one), splits it into
``microbatches`` equal micro-batches, runs them through the stages by the chosen schedule of
``torch.distributed.pipelining`` and returns the global loss, the mean of the micro-batches'
losses, on every process (one device's loss when ``loss_fn`` is a mean over equal
micro-batches). Gradients are those of that loss.
"""

from __future__ import annotations

import torch.nn as nn

from torchspmd import engines
from torchspmd.errors import SpmdError
from torchspmd.mesh import Mesh, as_view, get_global_mesh
from torchspmd.pipeline_schedules import SCHEDULES

__all__ = ["pipeline", "SCHEDULES", "is_split"]


def _layer_names(model: nn.Module, split) -> list[str]:
    if isinstance(split, type) and issubclass(split, nn.Module):
        names = [n for n, m in model.named_modules() if isinstance(m, split) and n]
        if not names:
            raise SpmdError(f"pipeline(split={split.__name__}): the model has no {split.__name__} module; give the "
                            f"class of its decoder layers, or the names of the modules that begin each stage")
        parents = {n.rsplit(".", 1)[0] if "." in n else "" for n in names}
        nested = [n for n in names if any(n != m and n.startswith(m + ".") for m in names)]
        if nested or len(parents) != 1:
            raise SpmdError(f"pipeline(split={split.__name__}): its modules must be the children of one container "
                            f"(a ModuleList), found them under {sorted(parents)}; give the module names instead")
        return names
    if isinstance(split, (list, tuple)) and split and all(isinstance(s, str) for s in split):
        known = dict(model.named_modules())
        for s in split:
            if s not in known or not s:
                raise SpmdError(f"pipeline(split=...): {s!r} is not a module of the model")
        if len(set(split)) != len(split):
            raise SpmdError(f"pipeline(split={list(split)}): a module is named twice")
        return list(split)
    raise SpmdError(f"pipeline(split={split!r}): give a module class (the decoder layer) or a list of module names")


def pipeline(model: nn.Module, mesh: Mesh | None = None, *, axis: str = "pipeline", split=None, microbatches: int,
             schedule: str = "1f1b", example_inputs=None):
    """Split ``model`` into stages over the mesh axis ``axis`` and return its runner.

    Args:
        mesh: default: the global mesh. Its ``axis`` gives the number of stages.
        split: the class of the layers the model is cut between (stages balanced by
            parameter count; the modules before the first layer go to the first stage, those
            after the last to the last), or the names of the modules, in order, among which
            the cuts are chosen the same way.
        microbatches: the number of micro-batches each global batch is split into (a divisor
            of its rows).
        schedule: ``'gpipe'``, ``'1f1b'``, ``'interleaved-1f1b'`` or ``'zero-bubble'`` (the
            last two: two stages per process).
        example_inputs: one global batch's inputs, of the steps' shape: the stages are traced
            with it now rather than at the first step. Needed with an ``'fsdp'`` axis of more
            than one device, whose stages are sharded over it before the optimizer is built.

    The stages are traced for one micro-batch shape and training mode (torch's pipeline
    tracer cannot trace a model again once it is split): a step or evaluation with another
    shape or mode is an ``SpmdError`` on every process; pad batches to one shape.
    """
    engine = engines.current("pipeline")
    if not engine.capabilities.pipeline_stages:
        raise SpmdError(f"pipeline: the {engine.name} engine has no pipeline stages; run on the native engine "
                        f"(GPUs or CPUs)")
    mesh = mesh or get_global_mesh()
    if mesh is None:
        raise SpmdError("pipeline(mesh=...): give a mesh with a 'pipeline' axis, or set_global_mesh(mesh) first")
    view = as_view(mesh, "pipeline(mesh=...)")
    if view.axis_names is None or axis not in view.axis_names:
        raise SpmdError(f"pipeline(axis={axis!r}): the mesh has no such axis ({view!r}); name one axis "
                        f"{axis!r}, e.g. Mesh(ids, (2,), ('pipeline',))")
    if schedule not in SCHEDULES:
        raise SpmdError(f"pipeline(schedule={schedule!r}): choose one of {', '.join(SCHEDULES)}")
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise SpmdError(f"pipeline(microbatches={microbatches!r}): give a positive number")
    if split is None:
        raise SpmdError("pipeline(split=...): give the class of the model's decoder layers, or module names")
    return engine.pipeline(model, mesh, axis, _layer_names(model, split), microbatches, schedule, example_inputs)


def is_split(model: nn.Module) -> bool:
    """Whether ``model`` was split into pipeline stages (``pipeline``): it then runs through
    the stages' runner."""
    engine = engines.started()
    return engine is not None and engine.is_pipelined(model)
