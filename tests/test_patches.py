"""torchspmd's changes to other libraries' objects (torchspmd/patches): none at import, the
native engine's applied by use_spmd(), each undone by its removal, and a patch whose target a
library version lacks refused with the version and the feature named."""

import pytest
from _clean import run_clean


def _torch_state() -> dict:
    """What the native engine's patches change, as identities and counts."""
    import sys

    import torch
    from torch.distributed.tensor import DTensor
    from torch.nn.modules import module

    return {
        "profile_hook_step": id(torch.optim.Optimizer.__dict__["profile_hook_step"]),
        "function modes": torch._C._len_torch_function_stack(),
        "op handlers": len(DTensor._op_dispatcher._custom_op_handlers),
        "dtensor local_shards": hasattr(DTensor, "local_shards"),
        "parameter registration hooks": len(module._global_parameter_registration_hooks),
        "forward pre hooks": len(module._global_forward_pre_hooks),
        "meta_path": len(sys.meta_path),
    }


def _import_then_spmd_then_remove():
    fresh = _torch_state()
    import torchspmd as ts
    from torchspmd import patches

    imported = (_torch_state(), [p.name for p in patches.active()])
    ts.use_spmd(backend="cpu")
    applied = (_torch_state(), [p.name for p in patches.active()])
    patches.remove_all()
    return fresh, imported, applied, (_torch_state(), [p.name for p in patches.active()])


def test_nothing_at_import_the_engines_at_use_spmd_all_undone():
    fresh, imported, applied, removed = run_clean(_import_then_spmd_then_remove, allow_torchspmd=True)
    assert imported == (fresh, [])  # import torchspmd changes nothing
    state, names = applied
    assert names[:4] == ["torch.nn.Module registration hooks", "torch function mode: implicit replication",
                         "DTensor op handlers", "torch.optim.Optimizer.profile_hook_step"], names
    changed = {k for k in state if state[k] != fresh[k]}
    assert changed == {"profile_hook_step", "function modes", "op handlers", "dtensor local_shards",
                       "parameter registration hooks", "forward pre hooks"}, (state, fresh)
    assert removed == (fresh, [])  # every change undone


def _missing_target():
    import torch

    from torchspmd.patches import Patch, PatchUnavailable, apply

    patch = Patch(name="example", library="torch", what="changes DTensor's missing thing", why="a test",
                  checked="2.13.0", feature="the example feature",
                  targets=("torch.distributed.tensor:DTensor._no_such_attribute",))
    try:
        apply(patch, lambda: None)
    except PatchUnavailable as e:
        return str(e), torch.__version__
    return "applied", torch.__version__


def test_a_missing_target_names_the_library_version_and_the_feature():
    message, version = run_clean(_missing_target, allow_torchspmd=True)
    assert message.startswith("the example feature needs torch.distributed.tensor:DTensor._no_such_attribute "
                              "(changes DTensor's missing thing), which torch " + version), message
    assert "checked on torch 2.13.0: install one of those versions" in message, message


def _use_spmd_without(attribute_path: str):
    """use_spmd() on a torch that lacks what a patch touches (removed here)."""
    import importlib

    module, _, path = attribute_path.partition(":")
    owner_path, _, name = path.rpartition(".")
    owner = importlib.import_module(module)
    for part in filter(None, owner_path.split(".")):
        owner = getattr(owner, part)
    delattr(owner, name)
    import torchspmd as ts

    try:
        ts.use_spmd(backend="cpu")
    except ts.SpmdError as e:
        return type(e).__name__, str(e)
    return "started", ""


@pytest.mark.parametrize("target,feature", [
    ("torch.optim:Optimizer.profile_hook_step", "the automatic data-parallel path's optimizer step"),
    ("torch.nn.modules.module:register_module_parameter_registration_hook", "mark_sharding in place"),
])
def test_use_spmd_on_a_torch_without_a_patched_symbol_says_which_and_why(target, feature):
    kind, message = run_clean(_use_spmd_without, target, allow_torchspmd=True)
    assert kind == "PatchUnavailable" and message.startswith(f"{feature} needs {target}"), message


def _trainer_signature_changed():
    import inspect

    from transformers.trainer import Trainer

    from torchspmd.patches import PatchUnavailable
    from torchspmd.patches import transformers as transformers_patches

    original = Trainer._prepare_inputs

    def _prepare_inputs(self, batch):  # a transformers where the parameter was renamed
        return original(self, batch)

    Trainer._prepare_inputs = _prepare_inputs
    try:
        transformers_patches.check_trainer_overrides()
    except PatchUnavailable as e:
        return str(e), list(inspect.signature(Trainer._prepare_inputs).parameters)
    return "checked", []


def test_a_changed_private_trainer_method_is_named():
    pytest.importorskip("transformers")
    message, params = run_clean(_trainer_signature_changed, allow_torchspmd=True)
    assert params == ["self", "batch"]
    assert message.startswith("torchspmd.hf.Trainer with the FSDPv2 arguments overrides transformers' "
                              "Trainer._prepare_inputs, whose parameters changed in transformers"), message
    assert "(no inputs)" in message


def test_the_documented_catalogue_is_the_codes():
    from pathlib import Path

    from torchspmd import patches

    doc = (Path(__file__).resolve().parents[1] / "docs" / "patches.md").read_text()
    table = doc.split("tests/test_patches.py checks it is current -->\n", 1)[1].split("<!-- end", 1)[0]
    assert table == patches.markdown()
    assert len(patches.catalogue()) == len({p.name for p in patches.catalogue()})  # names are unique
