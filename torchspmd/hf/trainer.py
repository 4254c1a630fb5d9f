"""transformers' ``Trainer`` (and trl's ``SFTTrainer``) on torchspmd FSDPv2.

    from torchspmd.hf import fsdp_v2, Trainer      # instead of: from transformers import Trainer
    fsdp_v2.use_fsdp_v2()
    args = TrainingArguments(..., **fsdp_v2.get_fsdp_training_args(model))
    Trainer(model=model, args=args, train_dataset=ds).train()

Given the FSDPv2 arguments (``fsdp_config['xla_fsdp_v2']``) on the native engine, the
trainer runs the SPMD program torch_xla runs on a TPU host, over all the processes:

- the model is wrapped in ``SpmdFullyShardedDataParallel`` over the ``'fsdp'`` axis of
  a ``(devices, 1)`` mesh with axes ``('fsdp', 'tensor')`` (made the global mesh, as
  transformers does on a TPU) — with ``fsdp_config['model_axis'] = m``
  (``get_fsdp_training_args(model, model_axis=m)``) a ``(devices / m, m)`` mesh over
  ``('fsdp', 'model')``, the model computing tensor-parallel over ``'model'`` as its
  transformers plan says (``fsdp_v2.shard_by_tp_plan``) —, one unit per
  ``transformer_layer_cls_to_wrap`` layer (or by ``min_num_params``); parameters,
  gradients and optimizer state are split over the devices; ``xla_fsdp_grad_ckpt`` adds
  ``checkpoint_module`` to each wrapped layer and turns ``use_cache`` off; ``bf16=True``
  means what it means to the stock trainer: the forward runs under accelerate's bf16
  autocast (outputs converted to fp32) over fp32 parameters, gradients and reductions;
- ``per_device_train_batch_size`` is the global batch of one step (torch_xla's SPMD
  meaning: the batch of the one program, split over the devices): every process reads
  and collates the whole batch (so that dynamic padding agrees) and keeps its rows;
  in training a last batch that can't give every device a row is left out, other uneven
  batches are split unevenly, so ``dataloader_drop_last`` is not needed; in evaluation and
  prediction such a batch is made up by repeating its last row, and the rows added are
  taken out of the loss and the results (which have the stock trainer's rows); for a model
  computing its own loss it is run as pieces that only repeat one row (``_GlobalCollate``);
- the causal-LM loss is computed from the global logits: the exact single-device loss,
  also with unevenly padded labels, gradient accumulation, ``label_smoothing_factor`` and
  an MoE model's router load-balancing loss (over the global batch); a masked LM's and a
  token classifier's too (their labels as they are: the mean over the labelled tokens);
- ``save_model`` and checkpoints (written atomically) write a normal Hugging Face directory (safetensors,
  clean keys; a PEFT model saves its adapter), plus the optimizer state sharded with
  ``torch.distributed.checkpoint`` under ``optimizer/``; ``train(resume_from_checkpoint=...)``
  resumes from it on any number of devices.

Without those arguments, or on the XLA backend (torch_xla's own FSDPv2 path), the
classes are transformers' and trl's unchanged.
"""

from __future__ import annotations

import collections.abc
import copy
import os
import shutil
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler
from transformers.trainer import (
    Trainer as _StockTrainer,  # (not transformers.Trainer: see the module's end)
)
from transformers.trainer_pt_utils import get_module_class_from_name

from torchspmd import runtime
from torchspmd.checkpoint import optimizer_state
from torchspmd.checkpoint_format import files as checkpoint_files
from torchspmd.layouts.blocks import chunk
from torchspmd.data import shard_batch
from torchspmd.errors import SpmdError
from torchspmd.hf.fsdp_v2 import shard_by_tp_plan, unwrap_peft
from torchspmd.mesh import Mesh, set_global_mesh
from torchspmd.parallel import (
    FSDPv2,
    checkpoint_module,
    clip_grad_norm_,
    full_state_dict,
    load_full_state_dict,
    shard_in_place,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from torchspmd.parallel.pipeline import is_split
from torchspmd.patches import accelerate as accelerate_patches
from torchspmd.patches import transformers as transformers_patches
from torchspmd.runtime import global_runtime_device_count
from torchspmd.sharding import ShardingSpec
from torchspmd.tree import map_tensors

__all__ = ["Trainer", "SFTTrainer"]  # SFTTrainer: made on first use (needs trl)

OPTIMIZER_DIR = "optimizer"
SCHEDULER_NAME = "scheduler.pt"
STAGING_DIR = ".torchspmd-saving"  # where a checkpoint is written before its rename (under the run directory)
IGNORE_INDEX = -100


# -- data ------------------------------------------------------------------------------
class _EpochRandomSampler(RandomSampler):
    """A random order drawn from ``seed + epoch`` (as accelerate's seedable sampler): the
    same on every process, and the same as a single-process Trainer's."""

    def __init__(self, data_source, seed: int):
        super().__init__(data_source, generator=torch.Generator())
        self.initial_seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self):
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.epoch += 1


class _GlobalBatches(BatchSampler):
    """Global batches of indices; for training, a last batch too small to give every device
    a row is dropped (that is the only batch ``drop_last=False`` would keep and SPMD cannot
    split); for evaluation (``keep_last``) it is kept, and ``_GlobalCollate`` makes it up."""

    def __init__(self, sampler, batch_size: int, drop_last: bool, devices: int, keep_last: bool = False):
        super().__init__(sampler, batch_size, drop_last)
        self.devices = devices
        self.keep_last = keep_last

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self):
        for batch in super().__iter__():
            if self.keep_last or _splittable(len(batch), self.devices):
                yield batch
            else:
                _warn_left_out(len(batch), self.devices)

    def __len__(self) -> int:
        n = len(self.sampler)
        full, rest = divmod(n, self.batch_size)
        return full + (1 if (rest and not self.drop_last and (self.keep_last or _splittable(rest, self.devices)))
                       else 0)


def _warn_left_out(rows: int, devices: int) -> None:
    warnings.warn(f"torchspmd.hf.Trainer: the last batch of {rows} rows can't give each of the {devices} devices "
                  f"a row; it is left out")


#: Token classifiers whose own loss counts only some of the labelled tokens (where the
#: attention mask is 1, or Bros's first token of each box): their loss stays the model's.
_OWN_TOKEN_LOSS = frozenset({"BioGptForTokenClassification", "MraForTokenClassification",
                             "XLMRobertaXLForTokenClassification", "YosoForTokenClassification",
                             "BrosForTokenClassification"})

ADDED_ROWS_KEY = "_torchspmd_added_rows"  # (in a collated evaluation batch: how many rows were added)


class _LeftOut:
    """What ``_GlobalCollate`` returns for a training batch too small to split: skipped."""

    def __init__(self, rows: int):
        self.rows = rows


class _Pieces(list):
    """What ``_GlobalCollate`` returns for an evaluation batch it splits: the batches to run
    in its place, in order."""


class _GlobalCollate:
    """The trainer's collator, for a global batch. A batch too small to give every device a
    row (the last one) is, for evaluation, made up to the fewest rows that can be split by
    repeating its last row, and ``ADDED_ROWS_KEY`` says how many were added (the trainer
    takes them out of the loss and the results); for training it is left out (``_LeftOut``).
    Repeating an existing row keeps the padded length of the batch the same.

    ``pieces`` (a model computing its own loss, a mean over its rows, which the rows added
    would weigh in; not a causal LM, masked LM or token classifier, whose loss the trainer
    computes, leaving out the added rows' labels): such a batch is collated whole, then run
    as pieces of its rows that need no row added but copies of one — the first rows in a
    multiple of the devices, then each remaining row repeated once per device (copies of one
    row leave its mean as it is) —, padded as the whole batch."""

    def __init__(self, collator, devices: int, evaluation: bool, pieces: bool = False):
        self.collator, self.devices, self.evaluation, self.pieces = collator, devices, evaluation, pieces

    def __call__(self, samples):
        rows = len(samples)
        if _splittable(rows, self.devices):
            return self.collator(samples)
        if not self.evaluation or rows == 0:
            return _LeftOut(rows)
        if self.pieces and rows > 1:
            batch = self.collator(samples)
            if not isinstance(batch, collections.abc.Mapping):
                return _LeftOut(rows)
            even = rows - rows % self.devices
            parts = ([_rows_of(batch, rows, 0, even, 1)] if even else []) + [
                _rows_of(batch, rows, r, r + 1, self.devices) for r in range(even, rows)]
            for part in parts[1 if even else 0:]:
                part[ADDED_ROWS_KEY] = self.devices - 1
            return _Pieces(parts)
        whole = rows
        while not _splittable(whole, self.devices):
            whole += 1
        batch = self.collator(list(samples) + [samples[-1]] * (whole - rows))
        if not isinstance(batch, collections.abc.MutableMapping):
            return _LeftOut(rows)  # (no place to record the rows added)
        batch[ADDED_ROWS_KEY] = whole - rows
        return batch


def _rows_of(batch, rows: int, start: int, end: int, copies: int) -> dict:
    """Rows ``start:end`` of a collated batch (its tensors and lists with ``rows`` rows; other
    values as they are), ``copies`` times over."""
    def take(v):
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows:
            part = v[start:end]
            return part.repeat(copies, *([1] * (v.dim() - 1))) if copies > 1 else part.clone()
        if type(v) in (list, tuple) and len(v) == rows:
            return type(v)(list(v[start:end]) * copies)
        return v

    return {k: take(v) for k, v in batch.items()}


def _splittable(rows: int, devices: int) -> bool:
    """Whether every device gets a row when ``rows`` are split like ``torch.chunk``."""
    return rows > 0 and chunk(rows, devices, devices - 1)[1] > 0


class _GlobalLoader(DataLoader):
    """Global batches, each read whole by every process; batches ``_GlobalCollate`` left out
    (the last of an ``IterableDataset``'s stream, in training) are skipped with a warning."""

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.batch_sampler, "set_epoch"):
            self.batch_sampler.set_epoch(epoch)

    def __iter__(self):
        devices = self.collate_fn.devices
        for batch in super().__iter__():
            if isinstance(batch, _LeftOut):
                _warn_left_out(batch.rows, devices)
            elif isinstance(batch, _Pieces):
                yield from batch
            else:
                yield batch


# -- helpers ---------------------------------------------------------------------------
def _plain(obj: Any) -> Any:
    """DTensors (global values) as whole plain tensors."""
    return map_tensors(obj, lambda t: t.full_tensor() if isinstance(t, DTensor) else t)


def _causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor | None, shift_labels: torch.Tensor | None,
                    num_items_in_batch: Any, label_smoothing: float = 0.0) -> torch.Tensor:
    """transformers' causal-LM loss (``ForCausalLMLoss``) on global tensors, without
    flattening the batch: the sum of token losses over the labelled positions, divided by
    ``num_items_in_batch`` when given, else by their count. With ``label_smoothing`` e, a
    token's loss is transformers' ``LabelSmoother``'s: (1 - e) * its -log p plus e * the mean
    of -log p over the vocabulary (``F.cross_entropy``'s ``label_smoothing``)."""
    if shift_labels is None:
        logits = logits[:, :-1, :]
        shift_labels = labels[:, 1:]
    per_row = logits.float().transpose(1, 2)  # (batch, vocab, positions)
    total = F.cross_entropy(per_row, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum",
                            label_smoothing=label_smoothing)
    if num_items_in_batch is None:
        count = (shift_labels != IGNORE_INDEX).sum()
        return total / count
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.item()
    return total / num_items_in_batch


def _gather_global(data: Any, *args, **kwargs) -> Any:
    """Every process holds the global values: nothing to gather across processes."""
    return _plain(data)


def _without_hub_kernels(model) -> None:
    """transformers (5.25 with ``kernels`` >= 0.19.1) kernelizes a model at
    ``from_pretrained`` and again whenever ``train()``/``eval()`` changes its mode, for the
    model's device type; the ``kernels`` library refuses the ``'xla'`` device type, so the
    trainer's first ``model.train()`` on an XLA device raised. Every transformers model in
    the tree gets its kernelization undone (``set_use_kernels(False)``: the torch forward of
    each kernel layer) while it is still where it was loaded, before the trainer moves it."""
    if not isinstance(model, nn.Module):
        return
    for module in model.modules():
        if getattr(module, "use_kernels", False) and callable(getattr(module, "set_use_kernels", None)):
            module.set_use_kernels(False)


# -- the trainer -------------------------------------------------------------------------
class Trainer(_StockTrainer):
    """``transformers.Trainer`` training with torchspmd FSDPv2 when the training arguments
    carry the FSDPv2 config (``get_fsdp_training_args``); see the module's docstring."""

    def __init__(self, model=None, args=None, *pargs, **kwargs):
        if model is not None and is_split(unwrap_peft(model)):
            # The Trainer calls the model and the loss's backward itself, one batch at a time; the
            # stages' schedule interleaves micro-batches over processes and must own both.
            raise SpmdError("Trainer(model=...): the model is split into pipeline stages (torchspmd.pipeline); the "
                            "Trainer runs each batch's forward and backward itself and cannot run a pipeline "
                            "schedule. Train it with its runner in a loop of your own (runner.step(inputs, targets, "
                            "loss_fn), then the optimizer's step), or give the Trainer the model unsplit (FSDPv2, "
                            "get_fsdp_training_args)")
        config = self._spmd_config(args)
        self._spmd = config is not None
        if self._spmd:
            transformers_patches.check_trainer_overrides()
            if kwargs.get("model_init") is not None:
                raise SpmdError("Trainer(model_init=...): not supported with FSDPv2; pass the model itself")
            optimizers = kwargs.get("optimizers") or (None, None)
            if optimizers[0] is not None or optimizers[1] is not None:
                raise SpmdError(
                    "Trainer(optimizers=...): FSDPv2 replaces the model's parameters by their shards, so an "
                    "optimizer made before can't be used; pass optimizer_cls_and_kwargs=(cls, kwargs), or "
                    "subclass and override create_optimizer"
                )
            if args.fp16:
                raise SpmdError("TrainingArguments(fp16=True): not supported with FSDPv2 here (no loss scaling); "
                                "use bf16=True")
            args = copy.copy(args)
            # transformers would take these for its torch_xla path; torchspmd does the sharding.
            args.fsdp = False
            args.fsdp_config = {**args.fsdp_config, "xla": False, "xla_fsdp_v2": False}
            # Counts are global already: averaging over processes would count each token n times.
            args.average_tokens_across_devices = False
            if config.get("xla_fsdp_grad_ckpt") and args.gradient_checkpointing:
                args.gradient_checkpointing = False  # checkpoint_module does it, once per layer
            self._spmd_fsdp_config = config
        elif args is not None and runtime.is_spmd():
            caps = runtime.capabilities()
            if not caps.fused_optimizers and getattr(args.optim, "value", args.optim) == "adamw_torch_fused":
                # transformers' default optimizer: fused AdamW runs on CUDA/CPU only, not on XLA devices
                args = copy.copy(args)
                args.optim = type(args.optim)("adamw_torch")
            if not caps.hub_kernels:
                _without_hub_kernels(model)
        super().__init__(model, args, *pargs, **kwargs)
        if self._spmd:
            self._spmd_wrap()

    # -- set-up --------------------------------------------------------------------
    @staticmethod
    def _spmd_config(args) -> dict | None:
        cfg = getattr(args, "fsdp_config", None) or {}
        if not (getattr(args, "fsdp", None) and cfg.get("xla_fsdp_v2")):
            return None
        if not runtime.is_spmd():
            raise SpmdError(
                "torchspmd.hf.Trainer: the training arguments ask for FSDPv2 but SPMD mode is off; call "
                "torchspmd.hf.fsdp_v2.use_fsdp_v2() (or torchspmd.use_spmd()) at the start of the program, "
                "before building TrainingArguments"
            )
        if runtime.capabilities().transformers_shards:
            return None  # transformers' own torch_xla FSDPv2 path (wrapping by _xla_wrap)
        return dict(cfg)

    def _spmd_wrap(self) -> None:

        cfg = self._spmd_fsdp_config
        # As transformers' torch_xla path: a (devices, 1) mesh, made the global mesh; with a
        # 'model' axis (fsdp_config['model_axis']), (devices / m, m) and the model's
        # transformers tensor-parallel plan as sharding annotations.
        n = global_runtime_device_count()
        m = cfg.get("model_axis", 1)
        if type(m) is not int or m < 1 or n % m:
            raise SpmdError(f"fsdp_config['model_axis'] = {m!r}: give a size of the 'model' axis dividing the "
                            f"{n} devices")
        c = cfg.get("context_axis", 1)
        if type(c) is not int or c < 1 or n % c:
            raise SpmdError(f"fsdp_config['context_axis'] = {c!r}: give a size of the 'context' axis dividing the "
                            f"{n} devices")
        model = self.model
        if m > 1:
            mesh = Mesh(list(range(n)), (n // m, m), ("fsdp", "model"))
            shard_by_tp_plan(model, mesh)
        elif c > 1:
            mesh = Mesh(list(range(n)), (n // c, c), ("fsdp", "context"))
        else:
            mesh = Mesh(list(range(n)), (n, 1), ("fsdp", "tensor"))
        set_global_mesh(mesh)
        self._spmd_mesh = mesh
        policy, checkpointing = _wrapping(model, cfg)
        # Layers become FSDPv2 units in place (no wrapper module): the model keeps its module
        # names, which PEFT's adapter saving and transformers' optimizer grouping walk.

        def unit(module, *a, **k):
            return shard_in_place(checkpoint_module(module) if checkpointing else module, *a, **k)

        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            MODEL_FOR_MASKED_LM_MAPPING_NAMES,
            MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
        )

        # (named before fully_shard renames the class)
        name = type(unwrap_peft(model)).__name__
        self._spmd_causal_lm = name in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
        # A masked LM's or token classifier's own loss is the mean cross-entropy over its
        # labelled tokens: computed here from the global logits, as a causal LM's (not shifted).
        # Not an encoder-decoder model of those classes (BART: its labels make its decoder's
        # input), one that computes logits at the labelled tokens only (ModernBERT's
        # sparse_prediction), nor those counting only some labelled tokens (_OWN_TOKEN_LOSS).
        config = getattr(model, "config", None)
        self._spmd_token_labels = not self._spmd_causal_lm and name in (
            set(MODEL_FOR_MASKED_LM_MAPPING_NAMES.values()) | set(MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES.values())
        ) and name not in _OWN_TOKEN_LOSS and not getattr(config, "is_encoder_decoder", False) \
            and not getattr(config, "sparse_prediction", False)
        if not self._spmd_causal_lm:
            # The model's own loss is then a mean over this process's rows, made global as the
            # row-weighted mean: it must not be a sum divided by a global token count.
            self.model_accepts_loss_kwargs = False
        self.model_wrapped = FSDPv2(model, mesh, auto_wrap_policy=policy, auto_wrapper_callable=unit)
        if self.accelerator.native_amp:
            self._spmd_autocast(self.model_wrapped)
        self._spmd_rows = mesh.mesh_shape[mesh.axis_names.index("fsdp")]
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size"):
            rows = getattr(self.args, name)
            if not _splittable(rows, self._spmd_rows):
                raise SpmdError(
                    f"TrainingArguments({name}={rows}): under FSDPv2 this is the global batch, split over the "
                    f"{self._spmd_rows} devices of the 'fsdp' axis like torch.chunk (pieces of "
                    f"ceil({rows}/{self._spmd_rows})), which leaves a device without a row; use at least "
                    f"{self._spmd_rows} rows, e.g. a multiple of {self._spmd_rows}"
                )
        # Every process holds the global values: gathering them over processes would repeat them.
        # (evaluation_loop resets gather_function to accelerate's gather_for_metrics after each run)
        accelerate_patches.gather_globally(self.accelerator, _gather_global, self._spmd_gather_for_metrics)
        self.gather_function = self._spmd_gather_for_metrics

    def _spmd_autocast(self, wrapped: nn.Module) -> None:
        """``bf16=True`` as the stock trainer has it: accelerate's ``prepare`` runs the
        model's forward under its autocast context and converts the outputs to fp32; the
        sharded model skips ``prepare``, so its forward gets the same two wrappers here.
        (Not FSDP2's bf16 parameter casting: that computes norms, residuals and gradients in
        bf16 too, a different training from the stock trainer's.)"""
        from accelerate.utils import (
            convert_outputs_to_fp32,
            get_mixed_precision_context_manager,
        )

        autocast = get_mixed_precision_context_manager(self.accelerator.native_amp, self.accelerator.autocast_handler)
        wrapped._original_forward = wrapped.forward
        wrapped.forward = convert_outputs_to_fp32(autocast(wrapped.forward))

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if self._spmd:
            return self.model_wrapped
        if training and getattr(self, "is_fsdp_xla_v2_enabled", False) and runtime.is_spmd() \
                and runtime.capabilities().transformers_shards:
            return self._xla_wrap(model)  # (evaluation runs the model as it is, as transformers does)
        return super()._wrap_model(model, training, dataloader)

    def _xla_wrap(self, model):
        """transformers' torch_xla FSDPv2 wrapping, done with torchspmd's FSDPv2 (torch_xla's
        class): its default output sharding marks every batch tensor of the output, where
        transformers' marks only ``logits`` and fails on outputs without them (trl's
        fused-LM-head loss)."""
        if isinstance(model, FSDPv2):
            return model
        policy, checkpointing = _wrapping(model, self.args.fsdp_config)

        def unit(module, *a, **k):
            return FSDPv2(checkpoint_module(module) if checkpointing else module, *a, **k)

        return FSDPv2(model, auto_wrap_policy=policy, auto_wrapper_callable=unit)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if optimizer is None and self.optimizer is None and getattr(self, "is_fsdp_xla_v2_enabled", False):
            # transformers 5.x, torch_xla FSDP: the optimizer's creation is put off until the
            # model is wrapped and then never done (the wrapped model skips accelerate's
            # prepare). torch_xla's FSDPv2 shards the parameters in place, so the optimizer
            # made now holds the sharded parameters.
            self.create_optimizer()
        return super().create_scheduler(num_training_steps, optimizer)

    # -- data ------------------------------------------------------------------------
    def _get_dataloader(self, dataset, description, batch_size, sampler_fn=None, is_training=False,
                        dataloader_key=None):
        if not self._spmd:
            return super()._get_dataloader(dataset, description, batch_size, sampler_fn, is_training, dataloader_key)
        import datasets

        collator = self.data_collator
        if isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(self.data_collator, description=description)
        args = self.args
        # (evaluation: a short last batch is made up and the rows added taken out again; training:
        # left out, see _GlobalCollate)
        params: dict[str, Any] = dict(
            collate_fn=_GlobalCollate(collator, self._spmd_rows, evaluation=not is_training,
                                      pieces=not (self._spmd_causal_lm or self._spmd_token_labels)),
            num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers,
        )
        if args.dataloader_num_workers > 0:
            params["prefetch_factor"] = args.dataloader_prefetch_factor
            params["multiprocessing_context"] = args.dataloader_multiprocessing_context
        if isinstance(dataset, torch.utils.data.IterableDataset):
            # Every process reads the same stream (it must be deterministic) and keeps its rows.
            return _GlobalLoader(dataset, batch_size=batch_size, drop_last=args.dataloader_drop_last, **params)
        sampler = sampler_fn(dataset) if sampler_fn is not None else None
        if sampler is None:
            sampler = SequentialSampler(dataset)
        if type(sampler) is RandomSampler:
            seed = args.data_seed if args.data_seed is not None else args.seed
            sampler = _EpochRandomSampler(dataset, seed)
        batches = _GlobalBatches(sampler, batch_size, args.dataloader_drop_last, self._spmd_rows,
                                 keep_last=not is_training)
        return _GlobalLoader(dataset, batch_sampler=batches, **params)

    def _prepare_inputs(self, inputs):
        if self._spmd and isinstance(inputs, collections.abc.Mapping):
            inputs = self._spmd_take_added_rows(inputs)
        inputs = super()._prepare_inputs(inputs)
        if not self._spmd:
            return inputs

        # Each process keeps its rows of the global batch, as global DTensors (tensors of
        # another rank than 2 are split on dim 0 alike).
        # With a 'context' axis each sequence (dim 1 of the rank-2 tensors) is split over it.
        seq = "context" if "context" in self._spmd_mesh.axis_names else None
        return shard_batch(inputs, ShardingSpec(self._spmd_mesh, ("fsdp", seq)), device=self.args.device)

    def _spmd_take_added_rows(self, inputs):
        """An evaluation batch's rows added by ``_GlobalCollate`` get no loss (a causal LM's,
        masked LM's or token classifier's labels -100 there; other models' batches come as
        pieces, see ``_GlobalCollate``), and the results of a batch shorter than the evaluation batch size
        (the last) are cut to its real rows by ``_spmd_gather_for_metrics``: what accelerate's
        ``gather_for_metrics`` does for the stock trainer (the batch's loss, which
        ``evaluation_loop`` repeats batch-size times, included)."""
        from transformers.trainer_pt_utils import find_batch_size

        added = 0
        if ADDED_ROWS_KEY in inputs:
            inputs = dict(inputs)
            added = inputs.pop(ADDED_ROWS_KEY)
            labels = inputs.get("labels")
            if (self._spmd_causal_lm or self._spmd_token_labels) and isinstance(labels, torch.Tensor) \
                    and labels.dim() > 0:
                labels = labels.clone()
                labels[-added:] = IGNORE_INDEX
                inputs["labels"] = labels
        self._spmd_added_rows = added
        rows = find_batch_size(inputs)
        real = rows - added if rows is not None else None
        self._spmd_metric_rows = (real if not self.model.training and real is not None
                                  and real < self.args.eval_batch_size else None)
        return inputs

    def _spmd_gather_for_metrics(self, data, *args, **kwargs):
        data = _plain(data)
        rows = getattr(self, "_spmd_metric_rows", None)
        if rows is None:
            return data
        return map_tensors(data, lambda t: t[:rows] if isinstance(t, torch.Tensor) and t.dim() > 0 else t)

    def get_total_train_batch_size(self, args) -> int:
        if not self._spmd:
            return super().get_total_train_batch_size(args)
        return self._train_batch_size * args.gradient_accumulation_steps

    # -- loss and step ---------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        # (label_smoothing_factor too: transformers' LabelSmoother gives a wrong value on the
        # global DTensors, so the loss below smooths the labels itself)
        token_labels = self._spmd and self._spmd_token_labels and isinstance(inputs.get("labels"), torch.Tensor) \
            and not (inputs["labels"].is_floating_point() or any(k != "labels" and k.endswith("labels") for k in inputs))
        if not (self._spmd and (self._spmd_causal_lm or token_labels) and "labels" in inputs
                and self.compute_loss_func is None):
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        shift_labels = inputs.pop("shift_labels", None)
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        smoothing = self.label_smoother.epsilon if self.label_smoother is not None else 0.0
        if token_labels:
            # (the model divides by its own count of labelled tokens, not num_items_in_batch; other
            # labels, LUKE's entity_labels, would add a loss of their own: the model's loss then)
            loss = _causal_lm_loss(logits, None, labels, None, smoothing)
        else:
            loss = _causal_lm_loss(logits, labels, shift_labels, num_items_in_batch, smoothing)
        aux = self._spmd_router_aux_loss(outputs, inputs)
        if aux is not None:
            loss = loss + aux
        if isinstance(outputs, dict):
            outputs["loss"] = loss
        return (loss, outputs) if return_outputs else loss

    def _spmd_router_aux_loss(self, outputs, inputs):
        """An MoE causal LM's (Mixtral, Qwen2-MoE, ...) ``router_aux_loss_coef`` times its
        router load-balancing loss, which the model adds to its loss when given labels
        (``output_router_logits``; the labels were taken out here). Computed by the model's
        own ``load_balancing_loss_func`` over the router logits of the whole global batch and
        its attention mask: the loss one process computes over the whole batch (the model's
        ``aux_loss`` output is each process's over its own rows)."""
        import sys

        if not isinstance(outputs, dict) or outputs.get("aux_loss") is None:
            return None
        model = unwrap_peft(self.model)
        coef = getattr(model, "router_aux_loss_coef", None)
        if not coef:
            return None
        func = None
        for cls in type(model).__mro__:  # (fully_shard renames the class, in another module)
            func = getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)
            if func is not None:
                break
        router_logits = outputs.get("router_logits")
        experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
        batch = next((inputs[k] for k in ("attention_mask", "input_ids", "inputs_embeds")
                      if isinstance(inputs.get(k), DTensor)), None)
        if (func is None or not isinstance(router_logits, tuple) or not router_logits or experts is None
                or top_k is None or batch is None):
            raise SpmdError(f"{type(model).__name__}: its router load-balancing loss (output_router_logits) "
                            f"can't be computed over the global batch here; set output_router_logits=False")
        rows, length = batch.shape[0], batch.shape[1]

        def whole(t):
            # each layer's logits: (this process's rows * sequence length, experts) -> the whole batch's
            if isinstance(t, DTensor):
                return t.full_tensor()
            local = t.reshape(-1, length, t.shape[-1])
            shape = (rows, length, t.shape[-1])
            glob = DTensor.from_local(local, batch.device_mesh, batch.placements, run_check=False, shape=shape,
                                      stride=(length * t.shape[-1], t.shape[-1], 1))
            return glob.full_tensor().reshape(rows * length, t.shape[-1])

        mask = inputs.get("attention_mask")
        mask = _plain(mask) if mask is not None else None
        added = getattr(self, "_spmd_added_rows", 0)
        if added:  # (rows added to a short last evaluation batch: not routed, as labels -100 get no loss)
            mask = (mask.clone() if mask is not None
                    else torch.ones(rows, length, dtype=torch.long, device=router_logits[0].device))
            mask[-added:] = 0
        return coef * func(tuple(whole(t) for t in router_logits), experts, top_k, mask)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        return _plain(loss) if self._spmd else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        out = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        return _plain(out) if self._spmd else out

    def _clip_grad_norm(self, model):
        if not self._spmd:
            return super()._clip_grad_norm(model)
        return clip_grad_norm_(model.parameters(), self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if not self._spmd or grad_norm is not None:
            return super()._get_grad_norm(model, grad_norm)
        return clip_grad_norm_(model.parameters(), float("inf"))

    # -- saving and loading -----------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not self._spmd and self._xla_wrapped():
            return self._xla_save_model(output_dir, _internal_call)
        if not self._spmd:
            return super().save_model(output_dir, _internal_call)


        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = full_state_dict(self.model_wrapped)  # every process gathers; the first one keeps it
        # the first process writes; a failure there (a full disk) is every process's error
        checkpoint_files.on_rank0(lambda: self._save(output_dir, state_dict=state) if self.args.should_save else None,
                  lambda e: f"save_model: the model could not be written to {output_dir} ({checkpoint_files.why(e)}, on process 0)")
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _xla_wrapped(self) -> bool:
        return runtime.is_spmd() and runtime.capabilities().transformers_shards and isinstance(self.model, FSDPv2)

    def _xla_save_model(self, output_dir: str | None, _internal_call: bool) -> None:
        """A normal Hugging Face directory from the torch_xla FSDPv2 model (transformers'
        own TPU save does not unwrap torch_xla's wrapper and writes its state dict, with
        wrapper-prefixed keys, to pytorch_model.bin)."""
        from transformers.trainer import TRAINING_ARGS_NAME


        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = full_state_dict(self.model)  # the unwrapped model's keys, on the CPU
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            self.model.module.save_pretrained(output_dir, state_dict=state)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._spmd:
            return super()._save_optimizer_and_scheduler(output_dir)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        try:
            dcp.save({"optim": optimizer_state.optim_state(self.model_wrapped, optimizer)},
                     checkpoint_id=os.path.join(output_dir, OPTIMIZER_DIR))
        except CheckpointException as e:  # (a BaseException, on every process: DCP gathers the failures)
            raise SpmdError(f"the optimizer state: {checkpoint_files.shards_failed(e)}") from None
        checkpoint_files.on_rank0(lambda: torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
                  if self.args.should_save else None,
                  lambda e: f"the scheduler state could not be written ({checkpoint_files.why(e)}, on process 0)")

    def _save_checkpoint(self, model, trial) -> None:
        """transformers' checkpoint, written atomically: into ``<run dir>/.torchspmd-saving/``
        first, then, once every process has written its part and the files are synced,
        renamed to ``checkpoint-N`` (one rename), and only then are old checkpoints rotated
        out. A save that fails on any process raises the same ``SpmdError`` on every process
        and leaves no ``checkpoint-N`` behind: ``resume_from_checkpoint=True`` takes the last
        complete one, and the checkpoints saved before are unchanged."""
        if not self._spmd:
            return super()._save_checkpoint(model, trial)
        from transformers.trainer import TRAINER_STATE_NAME
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        run_dir = self._get_output_dir(trial=trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        final, staging_root = os.path.join(run_dir, name), os.path.join(run_dir, STAGING_DIR)
        staging = os.path.join(staging_root, name)
        unsaved, unchanged = f"checkpoint {final} was not saved", "the checkpoints saved before it are unchanged"

        def prepare() -> None:  # (what a killed save left there goes)
            if os.path.lexists(staging_root):
                shutil.rmtree(staging_root)
            os.makedirs(staging_root)

        checkpoint_files.on_rank0(prepare, lambda e: f"{unsaved}: {staging_root} cannot be made ({checkpoint_files.why(e)}, on process 0); "
                                     f"{unchanged}")
        # transformers writes the checkpoint under the run directory it asks for: the staging one
        self._get_output_dir = lambda trial=None: staging_root
        error = None
        try:
            super()._save_checkpoint(model, trial)
        except Exception as e:
            error = str(e) if isinstance(e, SpmdError) else checkpoint_files.why(e)
        finally:
            del self._get_output_dir
        # every process learns how every other's part went (no process goes on alone)
        world = dist.get_world_size() if dist.is_initialized() else 1
        errors = [error] * world
        if world > 1:
            dist.all_gather_object(errors, error)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            if self.args.process_index == 0:
                shutil.rmtree(staging_root, ignore_errors=True)
            where = "; ".join(f"process {r}: {e}" for r, e in failed[:4])
            raise SpmdError(f"{unsaved} ({where}); {unchanged}")
        # transformers recorded the best checkpoint's path as it wrote it (under the staging directory)
        best = self.state.best_model_checkpoint
        if best is not None and os.path.dirname(os.path.normpath(best)) == os.path.normpath(staging_root):
            self.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(os.path.normpath(best)))
        done = {"renamed": False}

        def publish() -> None:
            if self.args.should_save and best is not None and best != self.state.best_model_checkpoint:
                self.state.save_to_json(os.path.join(staging, TRAINER_STATE_NAME))
            for path, _, files in os.walk(staging):
                for f in files:
                    fd = os.open(os.path.join(path, f), os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                checkpoint_files.fsync_dir(path)
            if os.path.lexists(final):  # saved by an earlier run that went further
                aside = os.path.join(staging_root, f"{name}.replaced")
                os.replace(final, aside)
            os.replace(staging, final)  # atomic: the checkpoint appears whole or not at all
            done["renamed"] = True
            checkpoint_files.fsync_dir(run_dir)
            shutil.rmtree(staging_root, ignore_errors=True)
            if self.args.should_save:
                rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                                   best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

        def publish_failed(e: Exception) -> str:
            if done["renamed"]:
                return f"checkpoint {final} is saved, but older checkpoints could not be removed ({checkpoint_files.why(e)}, on process 0)"
            return f"{unsaved} ({checkpoint_files.why(e)}, on process 0, completing it); {unchanged}"

        checkpoint_files.on_rank0(publish, publish_failed)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._spmd:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, OPTIMIZER_DIR)
        if not os.path.isfile(os.path.join(path, ".metadata")):
            raise SpmdError(f"checkpoint {checkpoint}: no optimizer state ({OPTIMIZER_DIR}/.metadata is missing); "
                            f"it was not written by torchspmd.hf.Trainer, or its save did not finish")
        from pathlib import Path

        import torch.distributed.checkpoint as dcp


        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        model = self.model_wrapped
        # As torchspmd.checkpoint.load: the groups are compared before anything is loaded, and
        # the optimizer gets exactly the state the checkpoint holds (none for a parameter that
        # had none: plain SGD, a parameter without a gradient yet).
        groups = optimizer_state.read_groups(Path(path))
        differ = optimizer_state.groups_differ(groups, optimizer_state.group_names(model, optimizer))
        if differ:
            raise checkpoint_files.CheckpointMismatch(f"checkpoint {checkpoint} was saved with another optimizer: {differ}; build the "
                                     f"optimizer with the parameter groups of the one that saved it")
        saved = optimizer_state.saved_optim_state(Path(path), dcp.FileSystemReader(path).read_metadata(), model, optimizer)
        state = {"optim": {"state": optimizer_state.optim_targets(Path(path), saved, model, optimizer)}}
        if saved:
            dcp.load(state, checkpoint_id=path)
        optimizer_state.load_optim_state(model, optimizer, {"param_groups": groups, **state["optim"]})
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not self._spmd:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        weights = _read_hf_weights(resume_from_checkpoint)
        if _is_peft(self.model):
            adapter = getattr(self.model, "active_adapter", "default")
            adapter = adapter[0] if isinstance(adapter, (list, tuple)) else adapter
            keys = self.model_wrapped.state_dict().keys()
            named = {}
            for key in keys:
                short = key.replace(f".{adapter}.", ".")
                if short in weights:
                    named[key] = weights[short]
            if not named:
                raise SpmdError(f"checkpoint {resume_from_checkpoint}: its adapter weights match no parameter "
                                f"of this model")
            load_full_state_dict(self.model_wrapped, named, strict=False)
        else:
            load_full_state_dict(self.model_wrapped, weights, strict=True)


def _wrapping(model: nn.Module, cfg: dict):
    """The auto-wrap policy of transformers' FSDP config, as transformers' torch_xla path
    reads it: a parameter count (``min_num_params``), else the layer classes by name
    (``transformer_layer_cls_to_wrap``, else the model's ``_no_split_modules``); and whether
    to checkpoint each unit (which turns the model's KV cache off, as transformers does)."""
    policy = None
    explicit = bool(cfg.get("transformer_layer_cls_to_wrap"))
    names = cfg.get("transformer_layer_cls_to_wrap") or getattr(unwrap_peft(model), "_no_split_modules", None) or []
    if isinstance(names, str):
        names = [names]
    names = list(names)
    if not explicit:  # the model's own list may name classes it does not use
        names = [n for n in names if get_module_class_from_name(model, n) is not None]
    if cfg.get("min_num_params", 0) > 0:
        def by_size(module, recurse, unwrapped_params, _n=int(cfg["min_num_params"])):
            return size_based_auto_wrap_policy(module, recurse, unwrapped_params, min_num_params=_n)
        policy = by_size
    elif names:
        classes = set()
        for name in names:
            cls = get_module_class_from_name(model, name)
            if cls is None:
                raise SpmdError(
                    f"fsdp_config['transformer_layer_cls_to_wrap']: no module of class {name!r} in "
                    f"{type(model).__name__}; see torchspmd.hf.fsdp_v2.find_layer_classes(model)"
                )
            classes.add(cls)

        def by_class(module, recurse, unwrapped_params, _classes=frozenset(classes)):
            return transformer_auto_wrap_policy(module, recurse, unwrapped_params, _classes)
        policy = by_class
    checkpointing = bool(cfg.get("xla_fsdp_grad_ckpt"))
    if checkpointing:
        config = getattr(unwrap_peft(model), "config", None)
        if config is not None and getattr(config, "use_cache", False):
            config.use_cache = False  # as transformers: the cache and recomputation don't mix
    return policy, checkpointing


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _read_hf_weights(directory: str) -> dict[str, torch.Tensor]:
    """The tensors of a Hugging Face directory: a model (one or sharded safetensors) or a
    PEFT adapter."""
    import json

    from safetensors.torch import load_file

    for name in ("adapter_model.safetensors", "model.safetensors"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return load_file(path)
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(os.path.join(directory, f)))
        return out
    raise SpmdError(f"checkpoint {directory}: no model.safetensors, sharded safetensors index or "
                    f"adapter_model.safetensors in it")


# Under --xla-compat, stock ``transformers.Trainer`` is this module's: asked for while this
# module loaded transformers.trainer on its way, done now that ``Trainer`` is defined.
# (The stock class is imported above from ``transformers.trainer``, not read as
# ``transformers.Trainer``: that would make transformers' lazy module keep the stock class as
# its attribute before the patch.)
transformers_patches.trainer_defined(Trainer)


def _sft_trainer_class():
    try:
        import trl
    except ImportError:
        return None

    class SFTTrainer(trl.SFTTrainer, Trainer):
        """trl's ``SFTTrainer`` training with torchspmd FSDPv2 given the FSDPv2 arguments."""

        def __init__(self, model=None, args=None, *pargs, **kwargs):
            if args is not None and Trainer._spmd_config(args) is not None and (
                    getattr(args, "padding_free", False)
                    or (getattr(args, "packing", False)
                        and getattr(args, "packing_strategy", "bfd") in ("bfd", "bfd_split"))):
                # trl's padding-free collator puts the whole batch in one row (position_ids
                # restarting per sequence): there is no batch dimension to split over the devices.
                raise SpmdError(
                    "SFTConfig(packing=True) with packing_strategy='bfd' (trl's default) or 'bfd_split', or "
                    "padding_free=True: not supported with FSDPv2 here: the padding-free collator makes the global "
                    "batch a single row, which can't be split over the devices; use packing_strategy='wrapped', or "
                    "packing=False and padding_free=False")
            super().__init__(model, args, *pargs, **kwargs)

    return SFTTrainer


def __getattr__(name: str):
    if name == "SFTTrainer":
        cls = _sft_trainer_class()
        if cls is None:
            raise ImportError("torchspmd.hf.SFTTrainer needs trl: pip install 'torchspmd[hf]' (or pip install trl)")
        globals()["SFTTrainer"] = cls
        return cls
    raise AttributeError(name)
