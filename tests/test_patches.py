"""torchspmd's changes to other libraries' objects (torchspmd/patches): none at import, the
native engine's applied by use_spmd(), each undone by its removal, and a patch whose target a
library version lacks refused with the version and the feature named."""

import pytest
from _clean import run_clean

pytestmark = pytest.mark.smoke  # the version and signature checks matter most on the newest torch


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
    from torchspmd.patches import Patch, PatchUnavailable, apply, version

    patch = Patch(name="example", library="torch", what="changes DTensor's missing thing", why="a test",
                  versions=">=2.13", feature="the example feature",
                  targets=("torch.distributed.tensor:DTensor._no_such_attribute",))
    try:
        apply(patch, lambda: None)
    except PatchUnavailable as e:
        return str(e), version("torch")
    return "applied", version("torch")


def test_a_missing_target_names_the_library_version_and_the_feature():
    message, version = run_clean(_missing_target, allow_torchspmd=True)
    assert message.startswith("the example feature needs changes DTensor's missing thing: "
                              "torch.distributed.tensor:DTensor._no_such_attribute (changes DTensor's missing thing) "
                              f"is missing in torch {version}"), message
    assert "torchspmd's patch 'example' was verified on torch>=2.13; install torch>=2.13" in message, message


def _use_spmd_without(attribute_path: str):
    """use_spmd() on a torch that lacks what a patch touches (removed here)."""
    import importlib
    import warnings

    module, _, path = attribute_path.partition(":")
    owner_path, _, name = path.rpartition(".")
    owner = importlib.import_module(module)
    for part in filter(None, owner_path.split(".")):
        owner = getattr(owner, part)
    delattr(owner, name)
    import torchspmd as ts
    from torchspmd import patches

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            ts.use_spmd(backend="cpu")
        except ts.SpmdError as e:
            return type(e).__name__, str(e), []
    skipped = [(p.name, why) for p, why in patches.skipped()]
    return "started", [str(w.message) for w in seen if w.category is patches.PatchSkippedWarning], skipped


def test_use_spmd_on_a_torch_without_a_needed_patched_symbol_says_which_and_why():
    target = "torch.nn.modules.module:register_module_parameter_registration_hook"
    kind, message, _ = run_clean(_use_spmd_without, target, allow_torchspmd=True)
    assert kind == "PatchUnavailable" and message.startswith("mark_sharding in place needs global parameter "), message
    assert f"{target} (global parameter" in message and "is missing in torch" in message, message


def test_a_speed_patch_whose_target_is_missing_falls_back_with_one_warning():
    """The optimizer-step wrapper only buys speed: on a torch without it use_spmd() starts,
    warns once naming the patch and the version, and records why it was left out."""
    kind, warned, skipped = run_clean(_use_spmd_without, "torch.optim:Optimizer.profile_hook_step",
                                      allow_torchspmd=True)
    assert kind == "started", warned
    assert len(warned) == 1 and "torch.optim.Optimizer.profile_hook_step" in warned[0], warned
    assert warned[0].startswith("torchspmd: the automatic data-parallel path's optimizer step outside the function "
                                "mode is off and takes torch's own path: torch.optim:Optimizer.profile_hook_step"), warned
    assert [name for name, _ in skipped] == ["torch.optim.Optimizer.profile_hook_step"], skipped


def _outside_range(needed: bool, untested: bool):
    import os
    import warnings

    from torchspmd import patches

    if untested:
        os.environ[patches.UNTESTED_VERSIONS] = "1"
    patch = patches.Patch(name="example range", library="torch", what="an example change", why="a test",
                          versions=">=1.0,<2.0", feature="the example feature", needed=needed)
    installed = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            results = [patches.apply(patch, lambda: installed.append(1)), patches.apply(patch, lambda: installed.append(1))]
        except patches.PatchUnavailable as e:
            return "refused", str(e), [], installed
    return results, [str(w.message) for w in seen if w.category is patches.PatchSkippedWarning], \
        [why for _, why in patches.skipped()], installed


def test_a_needed_patch_outside_its_versions_is_refused_naming_them():
    from torchspmd.patches import version

    kind, message, _, installed = run_clean(_outside_range, True, False, allow_torchspmd=True)
    assert kind == "refused" and not installed
    assert message.startswith(f"the example feature needs an example change: torch {version('torch')} is outside the "
                              "versions torchspmd's patch 'example range' was verified on (torch>=1.0,<2.0)"), message
    assert "TORCHSPMD_UNTESTED_VERSIONS=1 applies it anyway" in message


def test_a_speed_patch_outside_its_versions_is_skipped_with_one_warning():
    results, warned, why, installed = run_clean(_outside_range, False, False, allow_torchspmd=True)
    assert results == [False, False] and not installed  # the library's own path
    assert len(warned) == 1 and "the example feature is off and takes torch's own path" in warned[0], warned
    assert why and "outside the versions" in why[0]


def test_untested_versions_apply_patches_outside_their_range():
    for needed in (True, False):
        results, warned, why, installed = run_clean(_outside_range, needed, True, allow_torchspmd=True)
        assert results == [True, True] and installed == [1] and not warned and not why


def test_versions_compare_by_release():
    from torchspmd.patches import in_range

    assert in_range("2.13.0+cpu", ">=2.13,<2.16") and in_range("2.15.0+cu130", ">=2.13,<2.16")
    assert not in_range("2.16.0.dev20261201", ">=2.13,<2.16") and not in_range("2.16.0", ">=2.13,<2.16")
    assert not in_range("2.12.1", ">=2.13,<2.16") and not in_range("not-a-version", ">=2.13")


def test_a_range_that_is_not_a_specifier_is_refused_when_defined():
    from torchspmd.patches import Patch

    with pytest.raises(ValueError, match="versions='2.13.0, 2.14.1' is not a PEP 440 specifier"):
        Patch(name="x", library="torch", what="x", why="x", versions="2.13.0, 2.14.1", feature="x")


def _fsdpv2_with_copy_out(changed: bool):
    """Two FSDPv2 steps on 2 processes with FSDP2's copy-out as it is, or with a signature of
    another torch (a new keyword-only parameter)."""
    import warnings

    import torch
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as group_mod

    if changed:
        original = group_mod.foreach_all_gather_copy_out

        def foreach_all_gather_copy_out(all_gather_result, fsdp_params, group, *, all_gather_output_fn=None,
                                        new_option=None):
            return original(all_gather_result, fsdp_params, group)

        group_mod.foreach_all_gather_copy_out = foreach_all_gather_copy_out
    import numpy as np

    import torchspmd as ts
    from torchspmd import patches

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ts.use_spmd()
        mesh = ts.Mesh(np.arange(2), (2, 1), ("fsdp", "model"))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
        wrapped = ts.FSDPv2(model, mesh, collectives="shm")
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        comm = type(wrapped._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm).__name__
        losses = []
        for _ in range(2):
            x = ts.mark_sharding(torch.randn(7, 5), mesh, ("fsdp", None))
            loss = wrapped(x).sin().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    warned = [str(w.message) for w in seen if w.category is patches.PatchSkippedWarning]
    return losses, comm, warned, [(p.name, why) for p, why in patches.skipped()]


def test_a_changed_fsdp2_signature_turns_the_shared_parameters_off_instead_of_crashing():
    """FSDP2's private copy-out with another signature (as torch 2.15 changed it once): the
    shared-memory parameters are left out when the unit is wrapped, with one warning (rank 0
    prints; the others are silent), and the run trains to the same losses."""
    changed = run_clean(_fsdpv2_with_copy_out, True, world=2, allow_torchspmd=True)
    as_is = run_clean(_fsdpv2_with_copy_out, False, world=2, allow_torchspmd=True)
    assert [r[1] for r in as_is] == ["SharedParamsAllGather"] * 2
    assert [r[1] for r in changed] == ["SharedMemoryAllGather"] * 2  # FSDP2's own all-gather into its buffers
    assert [len(r[2]) for r in changed] == [1, 0] and not any(r[2] for r in as_is), changed
    assert "_fsdp_param_group:foreach_all_gather_copy_out takes (all_gather_result, fsdp_params, group, " \
           "all_gather_output_fn, new_option)" in changed[0][2][0], changed[0][2]
    for rank in range(2):
        assert changed[rank][0] == as_is[rank][0] == as_is[0][0]
        assert [name for name, _ in changed[rank][3]] == ["FSDP2 foreach_all_gather / foreach_all_gather_copy_out"]


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
