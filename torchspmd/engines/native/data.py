"""The native engine's ``MpDeviceLoader``: global batches, each process reading only its own rows.

The wrapped loader describes the *global* batch (``batch_size`` is the global batch
size). Each process loads only the rows it holds under ``input_sharding``, moves them
to its device (in a background thread, for a device other than the CPU), and yields
DTensors of the global shape.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import queue
import threading
from collections.abc import Mapping
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils.data import DataLoader, IterableDataset

from torchspmd import accelerators
from torchspmd.layouts.blocks import block_of
from torchspmd.layouts.blocks import chunk as _chunk
from torchspmd.layouts.blocks import contiguous_stride as _contiguous_stride
from torchspmd.engines.native.global_view import early_reductions as _early
from torchspmd.engines.native.communication import cpu_shortcuts
from torchspmd.engines.native.global_view import sharding
from torchspmd.engines.native.start import global_mode
from torchspmd.engines.native.start.device_mesh import device_mesh
from torchspmd.engines.native.global_view.sharding import coordinate
from torchspmd.errors import SpmdError

__all__ = ["MpDeviceLoader", "shard_batch"]

_END = object()


class _Error:
    def __init__(self, exc: BaseException):
        self.exc = exc


class _Layout:
    """How the batch's tensors are laid out: per-key specs and the axes splitting rows."""

    def __init__(self, input_sharding: Any, who: str = "MpDeviceLoader"):
        self.who = who
        self.sharding = input_sharding
        specs = (
            list(input_sharding.values())
            if isinstance(input_sharding, dict)
            else ([input_sharding] if input_sharding is not None else [])
        )
        meshes = {id(s.mesh): s.mesh for s in specs}
        if len(meshes) > 1:
            raise SpmdError("MpDeviceLoader(input_sharding=...): all ShardingSpecs must use the same mesh")
        self.mesh = specs[0].mesh if specs else None
        self.minibatch = any(s.minibatch for s in specs)
        if self.minibatch and not all(s.minibatch for s in specs):
            raise SpmdError("MpDeviceLoader(input_sharding=...): mix of minibatch=True and False specs")
        row_axes = {s.resolved[0] if s.resolved else () for s in specs}
        # Axes that split dim 0 (the batch): shared by all specs, else no per-process reading.
        self.row_axes: tuple[int, ...] | None = row_axes.pop() if len(row_axes) == 1 else None
        if self.minibatch and not self.row_axes:
            raise SpmdError(
                f"{who}(input_sharding=...): a ShardingSpec with minibatch=True must split dim 0 (each process's "
                f"rows) over the data axes: name them first, e.g. ShardingSpec(mesh, ('fsdp', None), minibatch=True)"
            )
        if self.mesh is not None:
            self.dmesh = device_mesh(self.mesh)  # created here, in the main thread, on every rank
            self.coord = coordinate(self.mesh, dist.get_rank())
        self._rows_warned = False
        self._specs: dict = {}  # (placements, global shape, dtype) -> DTensorSpec

    @property
    def row_shards(self) -> int:
        if not self.row_axes or self.mesh is None:
            return 1
        n = 1
        for a in self.row_axes:
            n *= self.mesh.mesh_shape[a]
        return n

    def rows_of_this_rank(self, n: int) -> tuple[int, int]:
        """(start, length) of this process's rows in a global batch of ``n`` rows."""
        if not self.row_axes:
            return 0, n
        start, length = 0, n
        for a in self.row_axes:
            s, length = _chunk(length, self.mesh.mesh_shape[a], self.coord[a])
            start += s
        return start, length

    def _rows_at(self, n: int, coord: dict[int, int]) -> int:
        length = n
        for a in self.row_axes or ():
            _, length = _chunk(length, self.mesh.mesh_shape[a], coord[a])
        return length

    def global_tensor(self, local: torch.Tensor, placements, gshape: tuple[int, ...]) -> DTensor:
        """The global DTensor of shape ``gshape`` whose block here is ``local`` (contiguous).
        A batch's tensors keep their shapes from batch to batch: their layouts are made once
        and shared (``DTensor.from_local`` would make one per tensor, through an autograd
        function, on the loader's every batch)."""
        if local.requires_grad:  # (a tensor with a gradient keeps its link to the local one)
            return DTensor.from_local(local, self.dmesh, placements, run_check=False, shape=torch.Size(gshape),
                                      stride=_contiguous_stride(gshape))
        key = (tuple(placements), tuple(gshape), local.dtype)
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = DTensorSpec(self.dmesh, tuple(placements), tensor_meta=TensorMeta(
                torch.Size(gshape), _contiguous_stride(tuple(gshape)), local.dtype))
        return DTensor(local, spec, requires_grad=False)

    def spec_for(self, key, t: torch.Tensor):
        if isinstance(self.sharding, dict):
            return self.sharding[key]
        return self.sharding

    def placements_for(self, spec, t: torch.Tensor) -> list[Placement]:
        assert self.mesh is not None
        if spec is not None and spec.can_apply(t):
            return sharding.placements(spec.mesh, spec.resolved)
        # The spec does not fit this tensor's rank (labels beside images): split its batch
        # dim like the other tensors' so the global value is the same and each process keeps
        # only its rows.
        placements: list[Placement] = [Replicate()] * self.mesh.ndim
        if t.dim() > 0:
            for a in self.row_axes or ():
                placements[a] = Shard(0)
        return placements


def _map_batch(batch: Any, fn, key=None) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(key, batch)
    if isinstance(batch, Mapping):  # dicts, transformers' BatchEncoding
        return type(batch)({k: _map_batch(v, fn, k) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_map_batch(v, fn, key) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map_batch(v, fn, key) for v in batch)
    return batch


class _SliceBatches:
    """A batch sampler yielding this process's part of each global batch of indices."""

    def __init__(self, inner, layout: _Layout):
        self.inner = inner
        self.layout = layout
        self.global_sizes: collections.deque[int] = collections.deque()
        self.first: list | None = None

    def __len__(self):
        return len(self.inner)

    def __iter__(self):
        for indices in self.inner:
            indices = list(indices)
            n = len(indices)
            if self.first is None:
                self.first = indices
            start, length = self.layout.rows_of_this_rank(n)
            self.global_sizes.append(n)
            # A process whose block of this batch is empty (3 rows over 4 devices) reads one
            # row to learn the tensors' other dims and dtypes, and keeps none of it.
            yield indices[start : start + length] if length else indices[:1]


def _can_read_own_rows(loader: Any, layout: _Layout, batchdim: int) -> bool:
    return (
        isinstance(loader, DataLoader)
        and not isinstance(loader.dataset, IterableDataset)
        and loader.batch_sampler is not None
        and batchdim == 0
        and layout.mesh is not None
        and bool(layout.row_axes)
        and not layout.minibatch
    )


def _local_loader(loader: DataLoader, batch_sampler) -> DataLoader:
    kwargs = dict(
        batch_sampler=batch_sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        persistent_workers=loader.persistent_workers,
    )
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(loader.dataset, **kwargs)


def background_thread(device: torch.device) -> bool:
    """Whether the loader makes its batches in a thread of its own for ``device``: for a
    device other than the CPU (a copy to overlap), or on the CPU under
    ``TORCHSPMD_ACCELERATOR_PATH=1`` (``cpu_shortcuts``)."""
    return device.type != accelerators.CPU or not cpu_shortcuts.allowed()


class MpDeviceLoader:
    """The native engine's loader (``torchspmd.MpDeviceLoader`` documents the arguments,
    checked there)."""

    def __init__(self, loader, device, *, input_sharding=None, loader_prefetch_size: int = 8,
                 device_prefetch_size: int = 4, batchdim: int = 0, fixed_batch_size: bool = False,
                 host_to_device_transfer_threads: int = 1):
        self._loader = loader
        self._device = torch.device(device)
        self._layout = _Layout(input_sharding)
        self._prefetch = max(1, int(device_prefetch_size))
        self._batchdim = batchdim
        self._fixed = fixed_batch_size
        self.per_process_reading = _can_read_own_rows(loader, self._layout, batchdim)

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[Any]:
        return _Iterator(self)


class _Iterator:
    def __init__(self, owner: MpDeviceLoader):
        self.owner = owner
        self.layout = owner._layout
        self.queue: queue.Queue = queue.Queue(maxsize=owner._prefetch)
        self.stop = threading.Event()
        self.first_size: int | None = None
        self.previous: _early.BatchCounts | None = None  # the last batch's, not verified yet
        if owner.per_process_reading:
            self.slicer = _SliceBatches(owner._loader.batch_sampler, self.layout)
            source = iter(_local_loader(owner._loader, self.slicer))
        else:
            self.slicer = None
            source = iter(owner._loader)
        # The first batch is read here, in the caller's thread: the sampler draws its seed
        # from the main thread's generator, in the same order as the plain loader would.
        try:
            first = [next(source)]
        except StopIteration:
            first = []
        except Exception as e:  # delivered at the first next()
            first = [_Error(e)]
        if self.slicer is not None:
            self._check_same_batches(self.slicer.first or [])
        self.batches = self._batches(first, source)
        # A thread of its own overlaps the copies to a device with the program's work. On
        # the CPU there is no copy: a thread there would only take turns with the program's
        # thread for the interpreter (each torch call hands it over), and its batches'
        # reading would interleave with the program's random draws in an order of the
        # scheduler's; the batches are made at next(), as a plain DataLoader makes them.
        self.thread: threading.Thread | None = None
        self.failed: BaseException | None = None
        if background_thread(owner._device):
            self.thread = threading.Thread(target=self._work, daemon=True, name="torchspmd-loader")
            self.thread.start()

    def _check_same_batches(self, indices: list) -> None:
        """Every process must draw the same global batches (same sampler seed)."""
        if dist.get_world_size() == 1:
            return
        digest = hashlib.sha1(repr(indices).encode()).digest()[:7]
        mine = torch.tensor([int.from_bytes(digest, "little")], dtype=torch.int64)
        allv = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(allv, mine)
        if any(int(v) != int(mine) for v in allv):
            raise SpmdError(
                "MpDeviceLoader: the processes drew different global batches from the loader's sampler. "
                "Seed torch the same way on every process before iterating (torch.manual_seed(seed)), "
                "or give the DataLoader a generator with a fixed seed. A sampler that splits the data by "
                "process (DistributedSampler(num_replicas=xr.process_count(), ...): one process per device "
                "here, one per host on torch_xla) gives each process other batches: leave it out (the loader "
                "yields the global batch, every process alike), or give the spec minibatch=True (each "
                "process's loader yields its own rows of the global batch)"
            )

    def __iter__(self):
        return self

    def __next__(self):
        if self.previous is not None:
            # The batch before: its sizes, reduced while it was used (done by now), must have
            # agreed (a loss that read its counts checked them already). Checked before this
            # batch starts a collective: an error leaves every process at the same point.
            previous, self.previous = self.previous, None
            previous.verify()
        if self.thread is None:
            batch, counts = self._made_here()
        else:
            with self.queue.mutex:  # the batch about to be taken, if ready
                head = self.queue.queue[0] if self.queue.queue else None
            if type(head) is tuple:
                # Start its counts' collective before taking it: taking it wakes the loader's
                # thread, which would then hold the interpreter while the collective starts,
                # preparing the next batch on the program's time.
                head[1].start()
            item = self.queue.get()
            if item is _END:
                self.queue.put(_END)
                raise StopIteration
            if isinstance(item, _Error):
                self.queue.put(item)
                raise item.exc
            batch, counts = item
        counts.start()  # here, in the program's thread: a collective in program order
        if counts.sizes:
            self.previous = counts
        return batch

    def _made_here(self):
        """The next batch, made in the program's thread (outside the global view, as the
        loader's thread would make it). A loader that raised raises the same at every call
        after, as the threaded one does."""
        if self.failed is not None:
            raise self.failed
        suspended = global_mode.suspend()
        try:
            return next(self.batches)
        except StopIteration:
            self.failed = StopIteration()
            raise
        except BaseException as e:
            self.failed = e
            raise
        finally:
            global_mode.resume(suspended)

    def __del__(self):
        self.stop.set()
        try:  # unblock a waiting put
            while True:
                self.queue.get_nowait()
        except queue.Empty:
            pass

    # -- background thread ---------------------------------------------------------
    def _put(self, item) -> bool:
        # A blocking put: a put that polled (a timeout in a loop) woke this thread ten times a
        # second for the whole run, each wake taking the GIL from the training thread.
        if self.stop.is_set():
            return False
        self.queue.put(item)
        return not self.stop.is_set()

    def _batches(self, first: list, source) -> Iterator[tuple]:
        """(batch as global DTensors, its counts) for each batch of the wrapped loader."""
        if first and isinstance(first[0], _Error):
            raise first[0].exc
        for n, batch in enumerate(itertools.chain(first, source) if first else ()):
            if self.owner._fixed:
                size = self._batch_rows(batch)
                if self.first_size is None:
                    self.first_size = size
                elif size != self.first_size:
                    return
            yield self._shard(batch, n)

    def _work(self) -> None:
        try:
            for item in self.batches:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as e:  # delivered to the consumer
            self._put(_Error(e))

    def _batch_rows(self, batch) -> int | None:
        """The batch's size: the size along ``batchdim`` of its first tensor (torch_xla's
        rule), for ``fixed_batch_size``."""
        if self.slicer is not None and self.slicer.global_sizes:
            return self.slicer.global_sizes[0]
        tensors = []
        _map_batch(batch, lambda k, t: tensors.append(t) if t.dim() else None)
        if not tensors:
            return None
        dim = self.owner._batchdim
        if not -tensors[0].dim() <= dim < tensors[0].dim():
            raise SpmdError(f"MpDeviceLoader(batchdim={dim}): the batch's first tensor has "
                            f"{tensors[0].dim()} dims (shape {tuple(tensors[0].shape)}); give the dim its rows are on")
        return tensors[0].shape[dim]

    def _shard(self, batch, n: int):
        global_rows = self.slicer.global_sizes.popleft() if self.slicer is not None else None
        counts = _early.BatchCounts(summed=global_rows is not None or self.layout.minibatch, batch=n)
        return _shard_batch(batch, self.layout, self.owner._device, n, global_rows, counts), counts


def _shard_batch(batch, layout: _Layout, device: torch.device, n: int, global_rows: int | None,
                 counts: _early.BatchCounts):
    """Batch ``n`` as global DTensors. ``global_rows``: the batch holds only this
    process's rows of a batch of that many; None: it holds the whole batch. ``counts``:
    where each integer tensor's ignored entries are counted (``torchspmd.engines.native.global_view.early_reductions``)."""
    if isinstance(layout.sharding, dict):
        if not isinstance(batch, Mapping):
            raise ValueError(
                f"MpDeviceLoader: input_sharding is a dict (keys {sorted(layout.sharding)}) but the "
                f"batch is a {type(batch).__name__}; yield dict batches or pass one ShardingSpec"
            )
        for k, v in batch.items():
            if isinstance(v, torch.Tensor) and k not in layout.sharding:
                raise KeyError(
                    f"MpDeviceLoader: batch key {k!r} has no entry in input_sharding "
                    f"(keys {sorted(layout.sharding)}); add a ShardingSpec for it"
                )

    position = [0]

    def convert(key, t: torch.Tensor):
        label = repr(key) if key is not None else f"number {position[0]}"  # (a tuple's: by position)
        position[0] += 1
        if layout.mesh is None:
            return t.to(device, non_blocking=True)
        spec = layout.spec_for(key, t)
        placements = layout.placements_for(spec, t)
        if layout.minibatch and t.dim() > 0:
            # Each process yielded its own rows; every process yields parts of one size.
            gshape = (t.shape[0] * layout.row_shards, *t.shape[1:])
            read_start = 0
            for d in range(t.dim()):
                counts.agree(label, d, t.shape[d])
        elif global_rows is not None and t.dim() > 0:
            gshape = (global_rows, *t.shape[1:])
            read_start, _ = layout.rows_of_this_rank(global_rows)
            for d in range(1, t.dim()):  # (this process collated its own rows: the rest must agree)
                counts.agree(label, d, t.shape[d])
        else:
            gshape = tuple(t.shape)
            read_start = None
        block = block_of(gshape, layout.mesh.mesh_shape, placements, layout.coord)
        local = t
        for d, (start, length) in enumerate(block):
            if d == 0 and read_start is not None:
                if length == 0 and global_rows is not None and local.shape[0] == 1:
                    local = local[:0]  # the stand-in row of a process holding none of this batch
                if local.shape[0] != length:
                    raise SpmdError(
                        f"MpDeviceLoader: tensor {key!r} of batch {n} has {local.shape[0]} rows for this "
                        f"process, expected {length}: every tensor of a batch must have the batch on dim 0"
                    )
                continue
            if length != local.shape[d]:
                local = local.narrow(d, start, length)
        block = local
        local = local.contiguous().to(device, non_blocking=True)
        out = layout.global_tensor(local, placements, gshape)
        if t.dtype in _early.COUNTED_TYPES:
            if read_start is None and not layout.minibatch:  # this process holds the whole tensor
                index = counts.count(t, not counts.summed or dist.get_rank() == 0)
            else:  # its block: counted by one process of those holding the same block
                index = counts.count(block, all(
                    layout.coord[a] == 0 for a, p in enumerate(placements) if not p.is_shard()))
            _early.mark(out, counts, index)
        return out

    return _map_batch(batch, convert)


def shard_batch(batch: Any, input_sharding, device: torch.device) -> Any:
    """See ``torchspmd.shard_batch``."""
    layout = _Layout(input_sharding, who="shard_batch")
    if layout.mesh is None:
        raise SpmdError("shard_batch(input_sharding=...): give a ShardingSpec or a dict of them")
    if layout.minibatch:
        raise SpmdError("shard_batch(input_sharding=...): minibatch=True specs describe per-process parts; "
                        "shard_batch takes the whole batch")
    counts = _early.BatchCounts(summed=False)
    out = _shard_batch(batch, layout, torch.device(device), 0, None,
                       counts)
    counts.start()
    return out
