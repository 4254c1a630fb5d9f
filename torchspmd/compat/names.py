"""What ``--xla-compat`` says about torch_xla's names: the error for what it does not provide
(naming the API and its equivalent), and the reasons where what it provides differs from
torch_xla.

Every name of torch_xla's public modules imports under the layer (``torchspmd.compat.manifest``);
one the layer does not provide is a stand-in (``torchspmd.compat.stand_ins``) that raises
``NotProvidedError`` when it is used: called, instantiated, or an attribute read."""

from __future__ import annotations

import sys

from torchspmd.compat import manifest
from torchspmd.errors import SpmdError

__all__ = ["NotProvidedError", "NotProvidedAttributeError", "missing", "message", "equivalent", "EQUIVALENTS",
           "DIFFERENCES", "PREFIXES"]

#: the modules the layer answers for, and where its own live
PREFIXES = {"torch_xla": "torchspmd.compat.torch_xla", "optimum.tpu": "torchspmd.compat.optimum_tpu"}

_SPMD_LAUNCH = "SPMD: call torch_xla.runtime.use_spmd() and start the program with `torchspmd run --xla-compat " \
               "--nproc N script.py`"

# What to use instead of a torch_xla API that the layer does not provide. A key names an API
# or a module (then it holds for every name under it); the most specific key applies.
EQUIVALENTS = {
    "torch_xla.launch": _SPMD_LAUNCH,
    "torch_xla.distributed.xla_multiprocessing": _SPMD_LAUNCH,
    "torch_xla.core.xla_model.all_reduce": "annotate shardings (xs.mark_sharding): the engine inserts the "
                                           "collectives; or torch.distributed.all_reduce",
    "torch_xla.core.xla_model.all_gather": "xs.mark_sharding / clear_sharding; or torch.distributed.all_gather",
    "torch_xla.core.xla_model.reduce_scatter": "annotate shardings (xs.mark_sharding); or "
                                               "torch.distributed.reduce_scatter_tensor",
    "torch_xla.core.xla_model.all_to_all": "torch.distributed.all_to_all_single",
    "torch_xla.core.xla_model.collective_broadcast": "torch.distributed.broadcast",
    "torch_xla.core.xla_model.send": "torch.distributed.send",
    "torch_xla.core.xla_model.recv": "torch.distributed.recv",
    "torch_xla.core.xla_model.reduce_gradients": "nothing: under SPMD gradients are already those of the "
                                                 "global batch",
    "torch_xla.core.xla_model.set_rng_state": "torch.manual_seed(seed) (every process draws alike after "
                                              "use_spmd)",
    "torch_xla.core.xla_model.get_rng_state": "torch.get_rng_state() / torch.initial_seed()",
    "torch_xla.core.xla_model.fork_rng": "torch.random.fork_rng()",
    "torch_xla.core.xla_model.mesh_reduce": "plain tensor arithmetic on global values (the program sees one "
                                            "device)",
    "torch_xla.core.xla_model.get_memory_info": "torch.accelerator.get_memory_info() / torch.accelerator.memory_stats()",
    "torch_xla.core.xla_model.send_cpu_data_to_device": "tensor.to(torch_xla.device())",
    "torch_xla.core.functions": "torch.distributed.nn.functional (differentiable collectives)",
    "torch_xla.distributed.spmd.shard_as": "xs.mark_sharding of both tensors with the same spec",
    "torch_xla.distributed.parallel_loader.ParallelLoader": "torch_xla.distributed.parallel_loader.MpDeviceLoader",
    "torch_xla.distributed.parallel_loader.PerDeviceLoader": "torch_xla.distributed.parallel_loader.MpDeviceLoader",
    "torch_xla.distributed.fsdp.XlaFullyShardedDataParallel":
        "torch_xla.experimental.spmd_fully_sharded_data_parallel.SpmdFullyShardedDataParallel (FSDPv2)",
    "torch_xla.distributed.fsdp.xla_fully_sharded_data_parallel":
        "torch_xla.experimental.spmd_fully_sharded_data_parallel.SpmdFullyShardedDataParallel (FSDPv2)",
    "torch_xla.distributed.zero_redundancy_optimizer": "torch.distributed.optim.ZeroRedundancyOptimizer, or "
                                                       "FSDPv2",
    "torch_xla.distributed.data_parallel": "SPMD: FSDPv2, or mark_sharding of the batch",
    "torch_xla.distributed.xla_backend.ProcessGroupXla": "torch.distributed.init_process_group('xla') (the "
                                                        "native backend's group under --xla-compat)",
    "torch_xla.debug.profiler.trace": "torch_xla.debug.profiler.start_trace(log_dir) / stop_trace() (no profiler "
                                      "server runs here)",
    "torch_xla.debug.profiler.trace_detached": "torch_xla.debug.profiler.start_trace(log_dir) / stop_trace()",
    "torch_xla.runtime.use_spmd(auto=True)": "annotations (xs.mark_sharding) or FSDPv2: auto-sharding is the XLA "
                                             "compiler's",
    "torch_xla.amp.syncfree": "the torch.optim optimizers",
    "torch_xla.amp.GradScaler": "torch.amp.GradScaler",
    "torch_xla.utils.checkpoint.CheckpointFunction": "torch_xla.utils.checkpoint.checkpoint",
    "torch_xla.experimental.scan_layers": "a Python loop over the layers (torch.compile to compile it)",
    "torch_xla.experimental.scan": "a Python loop (torch.compile to compile it)",
    "torch_xla.experimental.eager": "nothing: the native engine runs every operation eagerly",
    "torch_xla.experimental.eager_mode": "nothing: the native engine runs every operation eagerly",
    "torch_xla.experimental.custom_kernel.flash_attention": "torch.nn.functional.scaled_dot_product_attention",
    "torch_xla.experimental.splash_attention": "torch.nn.functional.scaled_dot_product_attention",
}

# Names the layer provides, but not exactly as torch_xla does: why (docs/xla_compat.md shows each).
DIFFERENCES = {
    "torch_xla.experimental.custom_kernel.flash_attention":
        "PyTorch's scaled_dot_product_attention with torch_xla's arguments (scale sm_scale, ab added, causal "
        "mask): the same function, another kernel; partition_spec and mesh are not needed (the inputs carry "
        "their layout); segment ids are not provided",
    "torch_xla.distributed.spmd.xla_sharding.XLAPatchedLinear":
        "XLAPatchedLinear.apply(input, weight, bias) is torch.nn.functional.linear (torch_xla computes it with "
        "einsum for XLA's sharding propagation; DTensor's linear keeps the layouts); its forward/backward are not "
        "callable on their own. EinsumLinear and apply_xla_patch_to_nn_linear use it",
    "torch_xla.experimental.gradient_accumulation.gradient_accumulation":
        "a Python loop over the micro-batches (torch_xla traces train_step once into XLA's While loop): the same "
        "losses, gradients and carried tensors",
    "torch_xla.experimental.eager_mode":
        "nothing to switch: operations always run as issued (eager_mode(False) does not turn graph tracing on)",
    "torch_xla.distributed.spmd.api.auto_policy":
        "the marker of XLA's auto-sharding: distribute_module with it (or with no partition_fn) on an 'xla' mesh, "
        "or a call of it, raises NotProvidedError; the sharding would be the XLA compiler's choice",
    "torch_xla.distributed.spmd.api.xla_distribute_tensor":
        "returns a DTensor (torch_xla: an XLAShardedTensor); a placement list sharding one tensor dim over several "
        "mesh dims shards it over all of them (torch_xla keeps the last)",
    "torch_xla.core.xla_model.xla_device":
        "the native device (torch.device('cpu') or cuda:LOCAL_RANK), as torch_xla.device(): a tensor put there "
        "has it as its .device, so `t.device == xm.xla_device()` holds, but it is not torch.device('xla', 0) "
        "and its .type is not 'xla'. PyTorch cannot hold a tensor on an 'xla' device without torch_xla; "
        "'xla' and torch.device('xla', n) passed to PyTorch's calls mean this device",
    "torch_xla.torch_xla.device": "as xm.xla_device(): the native device, not torch.device('xla', 0)",
    "torch_xla.torch_xla.devices": "[torch_xla.device()]: the native device, not torch.device('xla', 0)",
    "torch_xla.core.xla_model.get_xla_supported_devices":
        "[str(torch_xla.device())], e.g. ['cpu'] (torch_xla: ['xla:0']); 'xla:0' is accepted where a device is "
        "passed",
    "torch_xla.core.xla_model.xla_real_devices":
        "this process's device as torch_xla names it, '<TYPE>:<rank>' (torch_xla under SPMD: 'CPU:0', the one "
        "process's). torchspmd runs one process per device",
    "torch_xla.core.xla_model.xla_replication_devices":
        "[xm.xla_real_devices()[0]]: the program sees one device (xr.world_size() is 1), as torch_xla's one "
        "process does under SPMD; local_devices may be left out",
    "torch_xla.core.xla_model.is_master_ordinal":
        "True in one process per host (local=True, the default) or in rank 0 (local=False). torch_xla under SPMD "
        "runs one process per host, whose ordinal is 0; torchspmd runs one per device, so it answers True in one "
        "of them: a block under it (writing a file, printing) runs once per host / once, as on torch_xla. No "
        "collective may run inside it (reading a sharded tensor's value is one)",
    "torch_xla.core.xla_model.master_print": "prints in the process is_master_ordinal(local) picks (rank 0 by "
                                             "default): once",
    "torch_xla.runtime.global_ordinal":
        "this process's rank (torch_xla under SPMD: 0, its one process per host). With one process per device, a "
        "process whose ordinal is 0 is the one writer, as on torch_xla",
    "torch_xla.runtime.local_ordinal": "this process's rank on its host (torch_xla under SPMD: 0)",
    "torch_xla.core.xla_model.get_local_ordinal": "as xr.local_ordinal(): this process's rank on its host "
                                                  "(torch_xla under SPMD: 0)",
    "torch_xla.core.xla_model.is_xla_tensor": "True for a tensor on this process's device (its .device is the CPU "
                                              "or the accelerator's, never 'xla')",
    "torch_xla.runtime.process_index":
        "this process's rank (torch_xla under SPMD: its host's index): a file written under `if "
        "xr.process_index() == 0` is written once",
    "torch_xla.runtime.process_count":
        "the number of processes, one per device (torch_xla under SPMD: one per host). A sampler that splits the "
        "data by process_count() / process_index() (DistributedSampler) with a plain ShardingSpec gives each "
        "process other batches: leave the sampler out, or give the spec minibatch=True",
    "torch_xla.runtime.local_process_count":
        "the processes on this host, one per device (torch_xla under SPMD: 1); as process_count()",
    "torch_xla.runtime.host_index": "this process's host, counted from its rank and the host's processes",
    "torch_xla.runtime.addressable_runtime_device_count":
        "1, the device this process drives (torch_xla under SPMD: the host's devices, its one process driving them "
        "all): a minibatch=True share of the batch sized by it is one device's, so the global batch is the same",
    "torch_xla.runtime.use_spmd":
        "torchspmd.use_spmd(): with several configured devices and no launcher the program is started once per "
        "device; sets XLA_USE_SPMD=1 as torch_xla does; auto=True raises NotProvidedError (auto-sharding is the "
        "XLA compiler's)",
    "torch_xla.runtime.device_type": "'CUDA' or 'CPU' (never 'TPU'): the native device's type",
    "torch_xla.torch_xla.compile":
        "runs fn as one step, eagerly (torch.compile is PyTorch's compiler if wanted); full_graph and "
        "max_different_graphs have no XLA tracing to limit",
    "torch_xla.torch_xla.sync": "ends the step and runs the step closures; the native engine ran every operation "
                                "when issued",
    "torch_xla.core.xla_model.mark_step": "as torch_xla.sync()",
    "torch_xla.core.xla_model.optimizer_step":
        "opt.step(**optimizer_args): gradients are already the global batch's, so groups and pin_layout have no "
        "reduction to shape; barrier=True ends the step",
    "torch_xla.core.xla_model.rendezvous": "payloads of every process in rank order (torch_xla: every host's "
                                           "process); replicas naming only some processes is refused",
    "torch_xla.core.xla_model.save":
        "whole CPU copies (sharded tensors gathered: every process calls it), written by rank 0 unless "
        "master_only=False",
    "torch_xla.core.xla_model.wait_device_ops": "torch.accelerator.synchronize() on an accelerator; nothing on CPU",
    "torch_xla.core.xla_model.optimization_barrier_": "nothing: a barrier to XLA's fusion; the native engine runs "
                                                      "operations as issued",
    "torch_xla.distributed.spmd.xla_sharding.mark_sharding":
        "returns a DTensor (which is an xs.XLAShardedTensor here) with the same attributes; a parameter or buffer "
        "is annotated in place (every module slot holding it), and so is a tensor the program put on 'xla' or an "
        "operation computed from one (it becomes the DTensor: torch.utils.swap_tensors); another tensor (made on "
        "the CPU and never moved, one held for backward) is not, and a call that drops the result then warns: use "
        "the returned value. Marking a sharded tensor again on its mesh re-lays it out (torch_xla asks to clear the "
        "annotation first); on another mesh it raises ShardingStateError, a RuntimeError as torch_xla's. On "
        "'model' the annotation means tensor parallelism",
    "torch_xla.distributed.spmd.xla_sharding.enable_manual_sharding":
        "returns this process's shard as a plain tensor (torch_xla: an XLAShardedTensor whose .global_tensor is "
        "that)",
    "torch_xla.distributed.spmd.xla_sharded_tensor.XLAShardedTensor":
        "an abstract class that every DTensor counts as (isinstance holds for the sharded tensors mark_sharding "
        "returns, and for parameters annotated in place). XLAShardedTensor(t, mesh_shape, partition_spec) lays t "
        "out so over a mesh of every device in order and returns the DTensor (torch_xla's wraps t and records "
        "them); without them t stays as it is laid out (a plain tensor: replicated). local_shards holds this "
        "process's one shard (torch_xla's process holds every local device's)",
    "torch_xla.distributed.spmd.xla_sharding.MarkShardingFunction":
        "MarkShardingFunction.apply(t, mesh, spec) is xs.mark_sharding_with_gradients(t, mesh, spec), as in "
        "torch_xla; its forward/backward are not callable on their own",
    "torch_xla.distributed.spmd.xla_sharding.apply_backward_optimization_barrier":
        "nothing: a barrier to XLA's fusion of the module's backward",
    "torch_xla.experimental.spmd_fully_sharded_data_parallel.SpmdFullyShardedDataParallel":
        "torchspmd's FSDPv2 (FSDP2 over 'fsdp'), same arguments; state_dict() keys have no _orig_module. prefix "
        "(a state dict torch_xla saved loads; one saved here needs the prefix to load into torch_xla's FSDPv2)",
    "torch_xla.experimental.distributed_checkpoint.manager.CheckpointManager":
        "numbered DCP checkpoints, each written as .<step>.tmp and renamed when complete; save_async completes "
        "before returning; reached_preemption is False (TPU-only detection)",
    "torch_xla.experimental.distributed_checkpoint.planners.SPMDSavePlanner":
        "DCP's default save planner; a sharded tensor's write item indexes its shard in local_shards (0: a "
        "process holds one)",
    "torch_xla.experimental.distributed_checkpoint.planners.SPMDLoadPlanner": "DCP's default load planner",
    "torch_xla.debug.metrics": "metrics_report() says the engine, devices, steps ended and memory peak; "
                               "counter_names() / metric_names() are empty and counter_value / metric_data None: "
                               "the native engine compiles no XLA graph",
    "torch_xla.debug.profiler.start_server": "returns a handle and starts no profiler server "
                                             "(use start_trace / stop_trace)",
    "torch_xla.debug.profiler.start_trace": "a torch.profiler trace in TensorBoard's format, one file per process",
    "torch_xla.amp.autocast_mode.autocast":
        "a function returning torch.autocast on the native device, bfloat16 unless dtype is given (torch_xla: a "
        "subclass of torch.amp.autocast_mode.autocast)",
    "torch_xla.utils.checkpoint.checkpoint": "torch.utils.checkpoint.checkpoint, reentrant by default as "
                                             "torch_xla's",
    "torch_xla.runtime.initialize_cache": "nothing: XLA's cache of compiled programs (torch.compile keeps its own)",
    "torch_xla._XLAC._get_xla_sharding_spec":
        "the HLO text of the tensor's layout as torch_xla prints it; a parameter FSDP keeps on the 'fsdp' "
        "sub-mesh reads as replicated over the other axes, a pending reduction (Partial) as replicated",
    "torch_xla.distributed.xla_backend":
        "importing it is not needed: under --xla-compat init_process_group('xla') and init_method='xla://' give "
        "the native backend's group (gloo on CPU; NCCL and gloo on CUDA: dist.get_backend() names them, not "
        "'xla'), and a call that matches the group torchspmd started (use_spmd) reuses it instead of failing",
}


class NotProvidedError(SpmdError, ImportError):
    """A torch_xla API that ``--xla-compat`` does not provide, raised when it is used. (An
    ``ImportError``, as a module's missing name, so that a program's ``except ImportError``
    fallbacks take it.)"""


class NotProvidedAttributeError(SpmdError, AttributeError):
    """The same, for an attribute read (of a stand-in class or object, or of a module outside
    torch_xla's manifest such as ``optimum.tpu``): an ``AttributeError``, so that ``hasattr`` is
    False and ``getattr(x, name, default)`` gives the default. (Python allows no class that is
    both.)"""


def missing(api: str) -> SpmdError:
    """The error for ``api`` in a module the manifest does not describe (``optimum.tpu``),
    raised by the ``__getattr__`` that calls this: a ``NotProvidedError`` when the lookup
    serves ``from m import name`` (the caller's frame is at ``IMPORT_FROM``; ``from``
    would turn an ``AttributeError`` into a bare "cannot import name"), else a
    ``NotProvidedAttributeError``."""
    import dis

    try:
        frame = sys._getframe(2)  # (0: here, 1: the __getattr__, 2: the code that looked the name up)
        imported = dis.opname[frame.f_code.co_code[frame.f_lasti]] == "IMPORT_FROM"
    except (AttributeError, IndexError, ValueError):
        imported = True
    return (NotProvidedError if imported else NotProvidedAttributeError)(message(api))


def equivalent(api: str) -> str | None:
    """What to use instead of ``api``: the entry of ``api``, of a name torch_xla gives the same
    object under, or of the closest module above them."""
    candidates = [api]
    module, _, name = api.rpartition(".")
    candidates += [f"{m}.{n}" for m, n in manifest.aliases(module, name)]
    for candidate in candidates:
        if candidate in EQUIVALENTS:
            return EQUIVALENTS[candidate]
    for candidate in candidates:
        parts = candidate.split(".")
        for i in range(len(parts) - 1, 1, -1):
            key = ".".join(parts[:i])
            if key in EQUIVALENTS:
                return EQUIVALENTS[key]
    return None


def message(api: str) -> str:
    eq = equivalent(api)
    text = (f"{api} is not provided under --xla-compat (torchspmd runs torch_xla SPMD programs on PyTorch's "
            f"engine; docs/xla_compat.md lists what is)")
    return text + (f"; use {eq} instead" if eq else "")
