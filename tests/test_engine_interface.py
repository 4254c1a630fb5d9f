"""The engine interface (torchspmd/engines/base.py): what a new engine must give, what it
gets derived, what stays optional."""

import pytest

from torchspmd.engines.base import Capabilities, Engine


def _minimal_engine(world: int, processes: int, index: int) -> Engine:
    """An engine that gives only the abstract methods."""
    abstract = sorted(Engine.__abstractmethods__)
    counts = dict(world_size=world, process_count=processes, process_index=index, local_device_count=world // processes,
                  local_ordinal=0)
    body = {name: (lambda self, *a, _v=counts.get(name), **k: _v) for name in abstract}
    body.update(name="tiny", backends=("tiny",), capabilities=Capabilities(
        process_per_device=processes == world, static_shapes=False, lazy_tensors=False, fused_optimizers=False,
        hub_kernels=False, transformers_shards=False, tuple_axes_in_mesh_order=False))
    return type("TinyEngine", (Engine,), body)()


def test_a_new_engine_gives_nineteen_methods_in_four_roles():
    assert len(Engine.__abstractmethods__) == 19
    roles = [c.__name__ for c in Engine.__mro__[1:5]]
    assert roles == ["Start", "Sharding", "Wrappers", "Checkpoints"]
    with pytest.raises(TypeError):  # one missing is refused at construction
        type("Incomplete", (Engine,), {n: (lambda self: None) for n in sorted(Engine.__abstractmethods__)[1:]})()


def test_the_other_counts_are_derived():
    # one process per device (the native engine's model)
    e = _minimal_engine(world=4, processes=4, index=3)
    assert (e.global_runtime_device_count(), e.global_device_count(), e.addressable_runtime_device_count(),
            e.addressable_device_count(), e.global_ordinal()) == (4, 4, 1, 1, 3)
    # one process per host driving 4 devices (torch_xla's model), the second of two hosts
    e = _minimal_engine(world=8, processes=2, index=1)
    assert (e.global_runtime_device_count(), e.addressable_runtime_device_count(), e.global_ordinal()) == (8, 4, 4)


def test_an_optional_role_raises_naming_the_engine():
    e = _minimal_engine(world=2, processes=2, index=0)
    for call in (lambda: e.replicate(None, None, [0], None, {}), lambda: e.checkpoint_module(None),
                 lambda: e.prime_optimizer(None), lambda: e.sharding_string(None)):
        with pytest.raises(NotImplementedError, match="the tiny engine does not provide it"):
            call()
    assert e.planned_processes("tiny", None) is None and e.tensor_parallel_layout(None) is None
    with e.step(0), e.watching_fallbacks(lambda: ("", "")) as seen:
        assert seen == []
