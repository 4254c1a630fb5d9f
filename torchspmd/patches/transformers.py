"""Changes to transformers (and the accelerate object its Trainer holds)."""

from __future__ import annotations

import inspect
import sys

from torchspmd.patches import Patch, PatchUnavailable, apply, replace_attribute, version

#: the private Trainer methods torchspmd.hf.Trainer overrides, with the parameters it relies on
TRAINER_PRIVATE_METHODS = {
    "_wrap_model": ("model", "training", "dataloader"),
    "_get_dataloader": ("dataset", "description", "batch_size", "sampler_fn", "is_training", "dataloader_key"),
    "_prepare_inputs": ("inputs",),
    "_clip_grad_norm": ("model",),
    "_get_grad_norm": ("model", "grad_norm"),
    "_save_optimizer_and_scheduler": ("output_dir",),
    "_save_checkpoint": ("model", "trial"),
    "_load_optimizer_and_scheduler": ("checkpoint",),
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
}

TRAINER_OVERRIDES = Patch(
    name="transformers Trainer private methods (overridden)",
    library="transformers",
    what="torchspmd.hf.Trainer overrides Trainer." + ", Trainer.".join(TRAINER_PRIVATE_METHODS) + " (a subclass: "
         "nothing of transformers' is changed; checked because these are not public API)",
    why="the Trainer has no public extension points for a sharded model's data loading, gradient norm, checkpoint "
        "and resume",
    versions=">=5.24,<5.26",
    feature="torchspmd.hf.Trainer with the FSDPv2 arguments",
    targets=tuple(f"transformers.trainer:Trainer.{m}" for m in TRAINER_PRIVATE_METHODS),
)


def check_trainer_overrides() -> None:
    """The private methods exist and take the parameters the overrides pass on."""
    def install():
        from transformers.trainer import Trainer

        for name, params in TRAINER_PRIVATE_METHODS.items():
            have = inspect.signature(getattr(Trainer, name)).parameters
            lacking = [p for p in params if p not in have]
            if lacking:

                raise PatchUnavailable(
                    f"{TRAINER_OVERRIDES.feature} overrides transformers' Trainer.{name}, whose parameters changed in "
                    f"transformers {version('transformers')} (no {', '.join(lacking)}); it was verified on "
                    f"transformers{TRAINER_OVERRIDES.versions}: install transformers{TRAINER_OVERRIDES.versions}")
        return None

    apply(TRAINER_OVERRIDES, install)


TRAINER_CLASS = Patch(
    name="transformers.trainer.Trainer (--xla-compat)",
    library="transformers",
    what="transformers.trainer.Trainer and transformers.Trainer become torchspmd.hf.Trainer (a subclass that is the "
         "stock trainer unless given the FSDPv2 arguments); subclasses defined before are rebased on it",
    why="--xla-compat: programs written for transformers' torch_xla FSDPv2 path (optimum-tpu's) use the stock "
        "Trainer and trl's SFTTrainer, which must train sharded as torchspmd.hf.Trainer does",
    versions=">=5.24,<5.26",
    feature="--xla-compat with transformers' Trainer",
    targets=("transformers.trainer:Trainer",),
)

_WANTED: list[bool] = []


def replace_trainer(module, ours: type) -> None:
    """``module`` is transformers.trainer, just loaded: its ``Trainer`` becomes ``ours``."""
    original = module.Trainer
    if original is ours:
        return

    def install():
        undo = [replace_attribute(module, "Trainer", ours)]
        top = sys.modules.get("transformers")
        if top is not None and top.__dict__.get("Trainer") is original:  # resolved and kept by the lazy module
            undo.append(replace_attribute(top, "Trainer", ours))
        for sub in list(original.__subclasses__()):  # defined before the patch (none in the usual order)
            if sub is not ours:
                undo.append(replace_attribute(sub, "__bases__",
                                              tuple(ours if b is original else b for b in sub.__bases__)))
        return lambda: [u() for u in reversed(undo)]

    apply(TRAINER_CLASS, install)


def replace_trainer_once_defined() -> None:
    """Ask for ``replace_trainer`` as soon as torchspmd's trainer is defined (it is being
    imported and has loaded transformers.trainer on its way)."""
    _WANTED.append(True)


def trainer_defined(ours: type) -> None:
    """torchspmd.hf.trainer defined its ``Trainer``: do a replacement asked for meanwhile."""
    if _WANTED and "transformers.trainer" in sys.modules:
        _WANTED.clear()
        replace_trainer(sys.modules["transformers.trainer"], ours)
