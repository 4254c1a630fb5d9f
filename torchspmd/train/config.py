"""The train job's configuration: one typed object, presets, TOML files and flags.

Precedence: preset < TOML file (``--config``) < flags (``--model.dim 512``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from torchspmd._errors import SpmdError


def _f(default: Any, help: str, **kw):
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class ModelConfig:
    name: str = _f("llama", "architecture: 'seed' (torchspmd's decoder) or a transformers model type "
                            "(llama, mistral, qwen2, gemma, gpt2, ...)")
    pretrained: str = _f("", "local directory of a pretrained transformers model to fine-tune "
                             "(its architecture and weights replace the fields below)")
    dim: int = _f(128, "hidden size")
    num_layers: int = _f(4, "decoder layers")
    num_heads: int = _f(4, "attention heads")
    num_kv_heads: int = _f(0, "key/value heads (0: as many as attention heads)")
    intermediate_size: int = _f(384, "MLP hidden size")
    max_seq_len: int = _f(256, "positions the model supports")
    dropout: float = _f(0.0, "dropout probability (every dropout of the architecture)")
    meta_init: bool = _f(False, "build the model on the meta device and initialise each shard where it "
                                "lives: the whole model never exists on one device")


@dataclass
class DataConfig:
    path: str = _f("", "text to train on: a .txt/.jsonl/.parquet file, a directory of them, or a data set "
                       "saved with datasets.save_to_disk; empty: the Python standard library's own source")
    text_field: str = _f("text", "field holding the text in .jsonl/.parquet/datasets records")
    tokenizer: str = _f("byte", "'byte' (256 byte values + end of text) or a local tokenizer.json / "
                                "transformers tokenizer directory")
    seq_len: int = _f(128, "tokens per training sequence")
    max_bytes: int = _f(4_000_000, "read at most this many bytes of text (0: all)")
    eval_fraction: float = _f(0.02, "fraction of the sequences held out for evaluation")


@dataclass
class OptimConfig:
    lr: float = _f(3e-3, "peak learning rate (AdamW)")
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of the peak (cosine decay)")
    warmup_steps: int = _f(20, "linear warm-up steps")
    max_steps: int = _f(300, "optimizer steps to train")
    weight_decay: float = _f(0.1, "AdamW weight decay")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0: off)")
    batch_size: int = _f(16, "global batch size in sequences (all devices together)")
    grad_accum: int = _f(1, "micro-batches per optimizer step")
    max_bad_steps: int = _f(5, "stop after this many consecutive steps with a non-finite loss or gradient")


@dataclass
class MeshConfig:
    devices: int = _f(0, "processes (devices) on this host; 0: every CUDA device, else 2 CPU processes")
    data: int = _f(1, "replicas over an extra 'data' axis (hybrid sharding); the rest is 'fsdp'")
    model: int = _f(1, "size of the 'model' axis: tensor parallelism over it (a transformers model's own "
                       "tensor-parallel plan; the seed decoder's MLP, embedding and LM head); the rest is 'fsdp'")
    backend: str = _f("", "'cuda', 'cpu' or 'xla'; empty: xla when PJRT_DEVICE is set and torch_xla is "
                          "installed, else cuda when available, else cpu")


@dataclass
class PrecisionConfig:
    dtype: str = _f("fp32", "'fp32' or 'bf16' (bf16 compute, fp32 master weights and gradient reduction)")
    checkpointing: bool = _f(False, "recompute each decoder layer's activations in backward")


@dataclass
class CheckpointConfig:
    every: int = _f(100, "save a checkpoint every this many steps (and at the end)")
    keep: int = _f(2, "checkpoints to keep (the newest)")
    resume: str = _f("auto", "'auto' (continue from the newest checkpoint in out_dir if any), 'none', "
                             "or a checkpoint directory")


@dataclass
class LoggingConfig:
    every: int = _f(10, "log metrics every this many steps")
    eval_every: int = _f(100, "evaluate on held-out text every this many steps (and at the end)")
    eval_batches: int = _f(4, "batches per evaluation")
    tensorboard: bool = _f(True, "also write TensorBoard event files")
    progress: bool = _f(True, "show a live progress bar")
    sample_tokens: int = _f(200, "tokens of text to generate at the end (0: none)")
    prompt: str = _f("def ", "prompt for the final sample")


@dataclass
class TrainConfig:
    preset: str = _f("tiny", "named starting point (see --list-presets)")
    out_dir: str = _f("runs/tiny", "where checkpoints, metrics and plots go")
    seed: int = _f(0, "random seed")
    compile: bool = _f(False, "torch.compile each decoder layer (FSDPv2(compile=True))")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        top, sections = [], []
        for f in fields(self):
            v = getattr(self, f.name)
            if dataclasses.is_dataclass(v):
                body = "\n".join(f"{k} = {_toml_value(x)}" for k, x in dataclasses.asdict(v).items())
                sections.append(f"[{f.name}]\n{body}\n")
            else:
                top.append(f"{f.name} = {_toml_value(v)}")
        return "\n".join(top) + "\n\n" + "\n".join(sections)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


SECTIONS = {f.name: f.type for f in fields(TrainConfig) if f.name in
            ("model", "data", "optim", "mesh", "precision", "checkpoint", "logging")}

# Named presets: overrides of the defaults (which are `tiny`).
PRESETS: dict[str, dict] = {
    "tiny": {},
    "seed-tiny": {"out_dir": "runs/seed-tiny", "model": {"name": "seed"}},
    "small": {"out_dir": "runs/small",
              "model": {"dim": 512, "num_layers": 8, "num_heads": 8, "intermediate_size": 1536, "max_seq_len": 1024},
              "data": {"seq_len": 512, "max_bytes": 0}, "optim": {"lr": 1e-3, "batch_size": 64, "max_steps": 2000}},
    "llama-1b": {"out_dir": "runs/llama-1b",
                 "model": {"dim": 2048, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8,
                           "intermediate_size": 8192, "max_seq_len": 2048, "meta_init": True},
                 "data": {"seq_len": 2048, "max_bytes": 0},
                 "optim": {"lr": 3e-4, "batch_size": 256, "max_steps": 10000, "warmup_steps": 500},
                 "precision": {"dtype": "bf16", "checkpointing": True}},
    "llama2-7b": {"out_dir": "runs/llama2-7b",
                  "model": {"dim": 4096, "num_layers": 32, "num_heads": 32, "intermediate_size": 11008,
                            "max_seq_len": 4096, "meta_init": True},
                  "data": {"seq_len": 4096, "max_bytes": 0},
                  "optim": {"lr": 3e-4, "batch_size": 512, "max_steps": 20000, "warmup_steps": 2000},
                  "precision": {"dtype": "bf16", "checkpointing": True}},
}


def _coerce(value: Any, typ: Any, where: str) -> Any:
    typ = {"int": int, "float": float, "str": str, "bool": bool}.get(typ, typ) if isinstance(typ, str) else typ
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise SpmdError(f"{where}: expected true or false, got {value!r}")
    try:
        if typ is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return typ(value)
    except (TypeError, ValueError):
        raise SpmdError(f"{where}: expected {typ.__name__}, got {value!r}") from None


def apply_overrides(cfg: TrainConfig, overrides: dict, source: str) -> None:
    """Set ``{section: {field: value}, field: value}`` on ``cfg``; unknown keys are errors."""
    top = {f.name: f for f in fields(TrainConfig)}
    for key, value in overrides.items():
        if key not in top:
            raise SpmdError(f"{source}: unknown config key {key!r}; known: {', '.join(sorted(top))}")
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise SpmdError(f"{source}: [{key}] must be a table of settings")
            section = getattr(cfg, key)
            known = {f.name: f for f in fields(section)}
            for k, v in value.items():
                if k not in known:
                    raise SpmdError(f"{source}: unknown config key {key}.{k}; [{key}] has {', '.join(sorted(known))}")
                setattr(section, k, _coerce(v, known[k].type, f"{source}: {key}.{k}"))
        else:
            setattr(cfg, key, _coerce(value, top[key].type, f"{source}: {key}"))


def preset(name: str) -> TrainConfig:
    if name not in PRESETS:
        raise SpmdError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    cfg = TrainConfig(preset=name)
    apply_overrides(cfg, PRESETS[name], f"preset {name!r}")
    return cfg


def load_toml(path: str | Path) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    p = Path(path)
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "no such file"
        raise SpmdError(f"--config {path}: {what}; give the path of a TOML file "
                        f"(`torchspmd train --print-config` prints one to start from)")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise SpmdError(f"--config {path}: not a text file (not UTF-8); give a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise SpmdError(f"--config {path}: not valid TOML ({e}); fix the file: settings are `key = value` lines, "
                        f"strings in quotes, under [model], [data], ... tables") from None


def build_parser(prog: str = "torchspmd train") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Pretrain or fine-tune a decoder language model with FSDPv2 on every local device. "
                    "Settings come from a preset, then a TOML file, then these flags.",
    )
    p.add_argument("--config", help="TOML file with top-level keys and [model], [data], ... tables")
    p.add_argument("--list-presets", action="store_true", help="print the presets and exit")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration as TOML and exit")
    defaults = TrainConfig()
    for f in fields(TrainConfig):
        if f.name in SECTIONS:
            group = p.add_argument_group(f"[{f.name}]")
            for sf in fields(getattr(defaults, f.name)):
                group.add_argument(f"--{f.name}.{sf.name}", dest=f"{f.name}.{sf.name}", default=None,
                                   metavar=sf.type.upper() if isinstance(sf.type, str) else None,
                                   help=f"{sf.metadata['help']} (default: {getattr(getattr(defaults, f.name), sf.name)!r})")
        else:
            p.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=None,
                           help=f"{f.metadata['help']} (default: {getattr(defaults, f.name)!r})")
    p.add_argument("--resume", dest="checkpoint.resume", default=None, help="shorthand for --checkpoint.resume")
    return p


def from_args(argv: list[str]) -> tuple[TrainConfig, argparse.Namespace]:
    parser = build_parser()
    ns = parser.parse_args(argv)
    values = {k: v for k, v in vars(ns).items() if v is not None and k not in ("config", "list_presets", "print_config")}
    cfg = preset(values.pop("preset", "tiny"))
    if ns.config:
        apply_overrides(cfg, load_toml(ns.config), f"--config {ns.config}")
    nested: dict[str, Any] = {}
    for k, v in values.items():
        if "." in k:
            sec, name = k.split(".", 1)
            nested.setdefault(sec, {})[name] = v
        else:
            nested[k] = v
    apply_overrides(cfg, nested, "flags")
    validate(cfg)
    if not (ns.list_presets or ns.print_config):
        preflight(cfg)
    return cfg, ns


def validate(cfg: TrainConfig) -> None:
    m, d, o = cfg.model, cfg.data, cfg.optim
    for name, value in [("model.dim", m.dim), ("model.num_layers", m.num_layers), ("model.num_heads", m.num_heads),
                        ("data.seq_len", d.seq_len), ("optim.batch_size", o.batch_size),
                        ("optim.max_steps", o.max_steps), ("optim.grad_accum", o.grad_accum),
                        ("mesh.data", cfg.mesh.data), ("optim.max_bad_steps", o.max_bad_steps)]:
        if value < 1:
            raise SpmdError(f"{name} = {value}: must be at least 1")
    if cfg.mesh.devices < 0:
        raise SpmdError(f"mesh.devices = {cfg.mesh.devices}: give the number of devices (processes), "
                        f"or 0 for every CUDA device (else 2 CPU processes)")
    if not m.pretrained and m.dim % m.num_heads:
        raise SpmdError(f"model.dim = {m.dim} is not divisible by model.num_heads = {m.num_heads}")
    if d.seq_len > m.max_seq_len and not m.pretrained:
        raise SpmdError(
            f"data.seq_len = {d.seq_len} is beyond the model's positions (model.max_seq_len = {m.max_seq_len}); "
            f"lower data.seq_len or raise model.max_seq_len"
        )
    if d.path and not Path(d.path).exists():
        raise SpmdError(f"data.path = {d.path!r}: no such file or directory")
    if m.pretrained and not Path(m.pretrained).is_dir():
        raise SpmdError(f"model.pretrained = {m.pretrained!r}: no such directory")
    if not 0 <= d.eval_fraction < 0.5:
        raise SpmdError(f"data.eval_fraction = {d.eval_fraction}: choose a value in [0, 0.5)")
    if cfg.precision.dtype not in ("fp32", "bf16"):
        raise SpmdError(f"precision.dtype = {cfg.precision.dtype!r}: choose 'fp32' or 'bf16'")
    if o.batch_size % o.grad_accum:
        raise SpmdError(f"optim.batch_size = {o.batch_size} is not divisible by optim.grad_accum = {o.grad_accum}")


def _check_backend(cfg: TrainConfig) -> str:
    """The backend the job will use; a ``mesh.backend`` this machine cannot run is an error
    naming the setting."""
    from torchspmd import runtime

    b = cfg.mesh.backend.lower()
    if b and b not in runtime._BACKENDS:
        raise SpmdError(f"mesh.backend = {cfg.mesh.backend!r}: unknown backend; choose one of "
                        f"{', '.join(repr(x) for x in runtime._BACKENDS)}, or leave it empty to pick one")
    if b == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SpmdError("mesh.backend = 'cuda': no CUDA device is visible to PyTorch "
                            "(torch.cuda.is_available() is False); set mesh.backend = 'cpu' or leave it empty")
    return runtime._choose_backend(b or None)


def planned_devices(cfg: TrainConfig) -> int | None:
    """The number of devices (processes) the job will run on, known before any worker
    starts: ``WORLD_SIZE`` under a launcher, else what ``use_spmd`` will be given
    (``mesh.devices``, ``$TORCHSPMD_NUM_DEVICES``, the CUDA devices, 2 CPU processes).
    None on the XLA backend, where torch_xla counts its devices when it starts."""
    import os

    from torchspmd import runtime
    from torchspmd.train.loop import _device_count

    backend = _check_backend(cfg)
    if backend == "xla":
        return None
    if runtime._launched():
        return int(os.environ["WORLD_SIZE"])
    n = _device_count(cfg)
    return n if n is not None else runtime._configured_local_devices(backend)


def preflight(cfg: TrainConfig) -> None:
    """Checks that need the machine or the data, made where the job starts, before any
    worker process exists, so that a bad setting is one error, printed once: the backend
    and device count against ``mesh.*`` and the batch size, a pretrained model against the
    tokenizer and ``data.seq_len``, and the corpus against one batch. The corpus is
    tokenized here, into ``out_dir/cache`` (the workers map that file). Under a launcher
    (torchrun, ``torchspmd run``) every process checks the settings and the job's rank 0
    reads the corpus (``train.loop``)."""
    from torchspmd import runtime
    from torchspmd.train import data as tdata

    world = planned_devices(cfg)
    micro = cfg.optim.batch_size // cfg.optim.grad_accum
    if cfg.mesh.model < 1:
        raise SpmdError(f"mesh.model = {cfg.mesh.model}: give the size of the 'model' axis, 1 or more "
                        f"(1: no tensor parallelism)")
    if world is not None:
        mesh_checks(cfg, world)
    tokenizer = tdata.make_tokenizer(cfg.data.tokenizer)
    if cfg.model.pretrained:
        _check_pretrained(cfg, tokenizer)
    if not runtime._launched():
        tokens = tdata.load_tokens(cfg.data, tokenizer, Path(cfg.out_dir) / "cache")
        tdata.check_corpus(len(tokens), cfg.data, cfg.optim)


def mesh_checks(cfg: TrainConfig, world: int) -> None:
    """``mesh.data`` x ``mesh.model`` against the device count, the micro-batch against the
    data-parallel devices."""
    micro = cfg.optim.batch_size // cfg.optim.grad_accum
    divisors = [k for k in range(1, world + 1) if world % k == 0]
    if world % cfg.mesh.data:
        raise SpmdError(f"mesh.data = {cfg.mesh.data} does not divide the {world} devices; choose one of "
                        f"{', '.join(map(str, divisors))} (1: no extra 'data' axis)")
    if world % (cfg.mesh.data * cfg.mesh.model):
        fits = [k for k in divisors if (world // cfg.mesh.data) % k == 0]
        raise SpmdError(f"mesh.model = {cfg.mesh.model} does not divide the {world // cfg.mesh.data} devices left "
                        f"by mesh.data = {cfg.mesh.data}; choose one of {', '.join(map(str, fits))} "
                        f"(1: no tensor parallelism)")
    dp = world // cfg.mesh.model
    if micro % dp:
        raise SpmdError(f"the micro-batch of {micro} sequences (optim.batch_size / optim.grad_accum) is not "
                        f"divisible by the {dp} data-parallel devices; use a multiple of {dp}")


def _check_pretrained(cfg: TrainConfig, tokenizer) -> None:
    from torchspmd.train.models import pretrained_config

    d, where = cfg.data, f"model.pretrained = {cfg.model.pretrained!r}"
    config = pretrained_config(cfg.model.pretrained)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if vocab is not None and tokenizer.vocab_size > vocab:
        raise SpmdError(f"data.tokenizer = {d.tokenizer!r} has {tokenizer.vocab_size} tokens, more than the "
                        f"{vocab} of the model ({where}, its config's vocab_size): ids from {vocab} up would "
                        f"have no embedding; use the model's own tokenizer (data.tokenizer = "
                        f"{cfg.model.pretrained!r})")
    positions = getattr(text, "max_position_embeddings", None)
    if positions and d.seq_len > positions:
        raise SpmdError(f"data.seq_len = {d.seq_len} is beyond the {positions} positions of the model ({where}); "
                        f"lower data.seq_len to at most {positions}")
