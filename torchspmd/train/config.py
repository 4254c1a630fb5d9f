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

from torchspmd import runtime
from torchspmd.errors import SpmdError
from torchspmd.pipeline_schedules import SCHEDULES
from torchspmd.train import data as tdata
from torchspmd.train.models import model_vocab, pretrained_config


def _f(default: Any, help: str, **kw):
    return field(default=default, metadata={"help": help}, **kw)


def _help(text: str, default: Any) -> str:
    """A setting's ``--help`` line: its text and default, ``%`` escaped for argparse."""
    return f"{text} (default: {default!r})".replace("%", "%%")


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
    vocab_size: int = _f(0, "embedding rows (0: the tokenizer's vocabulary size); at least the tokenizer's")
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
    max_bytes: int = _f(4_000_000, "read at most this many bytes of text, UTF-8 (the document reaching "
                                    "it is cut there; 0: all)")
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
    fused: bool = _f(True, "PyTorch's fused AdamW kernel (one kernel over all parameters, CPU and CUDA; "
                           "false: the per-parameter loop). On XLA the step is compiled into the graph: not used")
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
    backend: str = _f("", "'cpu', an accelerator's device type (torch.accelerator's) or 'xla'; empty: xla when "
                          "PJRT_DEVICE is set and torch_xla is installed, else the accelerator PyTorch finds, else cpu")
    pipeline: int = _f(1, "size of the 'pipeline' axis: the model cut into that many stages between decoder "
                          "layers (torchspmd.pipeline), FSDPv2 over 'fsdp' inside each; 1 for none")
    context: int = _f(1, "size of the 'context' axis: each sequence split over that many processes (activation "
                         "memory divided, attention over the whole sequence); the rest is 'fsdp'; 1 for none")


@dataclass
class PipelineConfig:
    schedule: str = _f("1f1b", "with mesh.pipeline > 1: 'gpipe', '1f1b', 'interleaved-1f1b' or 'zero-bubble'")
    microbatches: int = _f(0, "micro-batches each step's batch is split into for the stages; 0: the fewest that "
                              "keep the schedule's idle share (bubble) at most 25%, printed at start")


@dataclass
class PrecisionConfig:
    dtype: str = _f("fp32", "'fp32' or 'bf16' (bf16 compute, fp32 master weights and gradient reduction)")
    checkpointing: bool = _f(False, "recompute each decoder layer's activations in backward")


@dataclass
class CheckpointConfig:
    every: int = _f(100, "save a checkpoint every this many steps (and at the end)")
    keep: int = _f(2, "checkpoints to keep (the newest; 0: all)")
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
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
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
            ("model", "data", "optim", "mesh", "pipeline", "precision", "checkpoint", "logging")}

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
    # llama-1b's shapes on 32k-token sequences, each split over a 'context' axis of 8 (ring attention)
    "llama-1b-32k": {"out_dir": "runs/llama-1b-32k",
                     "model": {"dim": 2048, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8,
                               "intermediate_size": 8192, "max_seq_len": 32768, "meta_init": True},
                     "data": {"seq_len": 32768, "max_bytes": 0}, "mesh": {"context": 8},
                     "optim": {"lr": 3e-4, "batch_size": 16, "max_steps": 10000, "warmup_steps": 500},
                     "precision": {"dtype": "bf16", "checkpointing": True}},
    "llama2-7b": {"out_dir": "runs/llama2-7b",
                  "model": {"dim": 4096, "num_layers": 32, "num_heads": 32, "intermediate_size": 11008,
                            "max_seq_len": 4096, "vocab_size": 32000, "meta_init": True},
                  "data": {"seq_len": 4096, "max_bytes": 0},
                  "optim": {"lr": 3e-4, "batch_size": 512, "grad_accum": 8, "max_steps": 20000, "warmup_steps": 2000},
                  "precision": {"dtype": "bf16", "checkpointing": True}},
}


@dataclass(frozen=True)
class Target:
    """Where a preset is meant to run: its defaults fit there per ``torchspmd plan``
    (checked by the test suite)."""
    devices: int
    memory_gb: float  # per device (a CPU process: its share of the host's memory)
    hardware: str


PRESET_TARGETS: dict[str, Target] = {
    "tiny": Target(2, 4, "2 CPU processes (a laptop), 4 GB each"),
    "seed-tiny": Target(2, 4, "2 CPU processes (a laptop), 4 GB each"),
    "small": Target(1, 24, "one 24 GB GPU (L4, A10, RTX 4090)"),
    "llama-1b": Target(8, 40, "8 x 40 GB GPUs (A100 40 GB)"),
    "llama-1b-32k": Target(8, 80, "8 x 80 GB GPUs (A100 80 GB, H100): each sequence over all 8"),
    "llama2-7b": Target(8, 80, "8 x 80 GB GPUs (A100 80 GB, H100); Llama-2's tokenizer "
                               "(data.tokenizer = its tokenizer.json, 32000 tokens)"),
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
            raise SpmdError(f"{source}: unknown config key {key!r}{did_you_mean(key, top)}; known: "
                            f"{', '.join(sorted(top))}")
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise SpmdError(f"{source}: [{key}] must be a table of settings")
            section = getattr(cfg, key)
            known = {f.name: f for f in fields(section)}
            for k, v in value.items():
                if k not in known:
                    raise SpmdError(f"{source}: unknown config key {key}.{k}{did_you_mean(k, known)}; [{key}] has "
                                    f"{', '.join(sorted(known))}")
                setattr(section, k, _coerce(v, known[k].type, f"{source}: {key}.{k}"))
        else:
            setattr(cfg, key, _coerce(value, top[key].type, f"{source}: {key}"))


def preset(name: str) -> TrainConfig:
    if name not in PRESETS:
        raise SpmdError(f"preset = {name!r}: unknown preset{did_you_mean(name, PRESETS)}; choose one of "
                        f"{', '.join(PRESETS)} (torchspmd train --list-presets describes them)")
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


TRAIN_DESCRIPTION = ("Pretrain or fine-tune a decoder language model with FSDPv2 on every local device. "
                     "Settings come from a preset, then a TOML file, then these flags.")


def build_parser(prog: str = "torchspmd train", description: str = TRAIN_DESCRIPTION) -> argparse.ArgumentParser:
    p = _Parser(prog=prog, allow_abbrev=False, description=description)
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
                                   help=_help(sf.metadata['help'], getattr(getattr(defaults, f.name), sf.name)))
        else:
            p.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=None,
                           help=_help(f.metadata['help'], getattr(defaults, f.name)))
    p.add_argument("--resume", dest="checkpoint.resume", default=None, help="shorthand for --checkpoint.resume")
    return p


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors raised as one ``SpmdError`` line (no usage dump), unknown
    options answered with the closest known ones."""

    def error(self, message: str):
        raise SpmdError(f"{self.prog.removeprefix('torchspmd ')}: {message} (--help lists the settings)")


def _unknown_options(parser: argparse.ArgumentParser, unknown: list[str]) -> None:
    if not unknown:
        return
    bad = unknown[0]
    option = bad.split("=", 1)[0]
    if not option.startswith("-"):
        raise SpmdError(f"{parser.prog.removeprefix('torchspmd ')}: unexpected argument {bad!r}: settings are given as --section.name VALUE "
                        f"(e.g. --optim.lr 1e-3)")
    prog = parser.prog.removeprefix('torchspmd ')
    if option.replace("_", "-") in ("--nproc", "--nproc-per-node") and "--mesh.devices" in parser._option_string_actions:
        # torchspmd run's and torchrun's option: this job starts its processes itself
        raise SpmdError(f"{prog}: unknown option {option}: the job starts its own processes, one per device: "
                        f"give their number as --mesh.devices N")
    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    raise SpmdError(f"{prog}: unknown option {option}{did_you_mean(option, known)} (--help lists the settings)")


def from_args(argv: list[str], prog: str = "torchspmd train",
              description: str = TRAIN_DESCRIPTION) -> tuple[TrainConfig, argparse.Namespace]:
    parser = build_parser(prog, description)
    ns, unknown = parser.parse_known_args(argv)
    _unknown_options(parser, unknown)
    values = {k: v for k, v in vars(ns).items() if v is not None and k not in ("config", "list_presets", "print_config")}
    from_file = load_toml(ns.config) if ns.config else {}
    # preset < TOML file < flags: a `preset` key in the file chooses the starting point (a
    # --preset flag wins), it does not just relabel the defaults
    flag = values.pop("preset", None)
    name = flag or from_file.get("preset", "tiny")
    if not isinstance(name, str):
        raise SpmdError(f"--config {ns.config}: preset: expected a preset name, got {name!r}")
    try:
        cfg = preset(name)
    except SpmdError as e:
        raise SpmdError(str(e) if flag else f"--config {ns.config}: {e}") from None
    if ns.config:
        apply_overrides(cfg, {k: v for k, v in from_file.items() if k != "preset"}, f"--config {ns.config}")
    nested: dict[str, Any] = {}
    for k, v in values.items():
        if "." in k:
            sec, name = k.split(".", 1)
            nested.setdefault(sec, {})[name] = v
        else:
            nested[k] = v
    apply_overrides(cfg, nested, "flags")
    explicit = {k for k in values if "." in k} | {f"{sec}.{k}" for sec, table in from_file.items()
                                                   if isinstance(table, dict) for k in table}
    cfg.adapted = adapt_defaults(cfg, explicit)
    validate(cfg)
    # The config is saved with every checkpoint and read back by export / generate / resume,
    # maybe from another directory: its input paths (checked to exist above) are made absolute.
    if cfg.data.path:
        cfg.data.path = str(Path(cfg.data.path).resolve())
    if cfg.data.tokenizer != "byte":
        cfg.data.tokenizer = str(Path(cfg.data.tokenizer).resolve())
    if cfg.model.pretrained:
        cfg.model.pretrained = str(Path(cfg.model.pretrained).resolve())
    if not (ns.list_presets or ns.print_config):
        preflight(cfg)
    return cfg, ns


def did_you_mean(name: str, choices, n: int = 3) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or ``""``."""
    import difflib

    close = difflib.get_close_matches(name, list(choices), n=n, cutoff=0.6)
    if not close:
        lowered = {c.lower(): c for c in choices}
        close = [lowered[name.lower()]] if name.lower() in lowered else []
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def causal_lm_types() -> list[str]:
    """The model types transformers can build as a causal language model."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _check_model_name(name: str) -> None:
    if name == "seed":
        return
    try:
        known = causal_lm_types()
    except ImportError:
        raise SpmdError(f"model.name = {name!r} needs transformers: pip install 'torchspmd[train]' "
                        f"(or model.name = 'seed', torchspmd's own decoder)") from None
    if name not in known:
        hint = did_you_mean(name, ["seed", *known])
        raise SpmdError(f"model.name = {name!r}: not a causal language model type transformers knows{hint}; "
                        f"choose 'seed' (torchspmd's decoder) or one of transformers' types (llama, mistral, qwen2, "
                        f"gemma, gpt2, ...)")


# (setting, lowest, highest or None, what it is): the inclusive range validate checks.
_RANGES = [
    ("model.dim", 1, None, "the hidden size"), ("model.num_layers", 1, None, "decoder layers"),
    ("model.num_heads", 1, None, "attention heads"), ("model.num_kv_heads", 0, None, "key/value heads, 0 for all"),
    ("model.intermediate_size", 1, None, "the MLP size"), ("model.max_seq_len", 1, None, "positions"),
    ("model.vocab_size", 0, None, "embedding rows, 0 for the tokenizer's"),
    ("data.seq_len", 1, None, "tokens per sequence"), ("data.max_bytes", 0, None, "bytes to read, 0 for all"),
    ("optim.min_lr_ratio", 0, 1, "the final learning rate as a fraction of the peak"),
    ("optim.warmup_steps", 0, None, "warm-up steps"), ("optim.max_steps", 1, None, "steps"),
    ("optim.weight_decay", 0, None, "the weight decay"), ("optim.grad_clip", 0, None, "the clipping norm, 0 for off"),
    ("optim.batch_size", 1, None, "sequences per step"), ("optim.grad_accum", 1, None, "micro-batches per step"),
    ("optim.max_bad_steps", 1, None, "non-finite steps tolerated"),
    ("mesh.data", 1, None, "the 'data' axis size"), ("mesh.model", 1, None, "the 'model' axis size, 1 for none"),
    ("mesh.pipeline", 1, None, "the 'pipeline' axis size, 1 for none"),
    ("mesh.context", 1, None, "the 'context' axis size, 1 for none"),
    ("pipeline.microbatches", 0, None, "micro-batches per batch, 0 for the automatic number"),
    ("checkpoint.every", 1, None, "steps between checkpoints"), ("checkpoint.keep", 0, None, "checkpoints kept, 0 for all"),
    ("logging.every", 1, None, "steps between log lines"), ("logging.eval_every", 1, None, "steps between evaluations"),
    ("logging.eval_batches", 1, None, "batches per evaluation"),
    ("logging.sample_tokens", 0, None, "tokens to sample, 0 for none"),
    ("seed", 0, 2**32 - 1, "the random seed"),
]


def adapt_defaults(cfg: TrainConfig, explicit: set[str]) -> list[str]:
    """Settings the user left at their default (or their preset's) that contradict one the
    user set are adapted to it, and said (the job prints each line under its config); a
    contradiction between two settings the user set stays an error (``validate``).

    - ``optim.warmup_steps`` longer than ``optim.max_steps``: a tenth of the run (rounded
      down; no warm-up for a run of under 10 steps).

    The intervals need nothing: a run shorter than ``checkpoint.every`` or
    ``logging.eval_every`` saves and evaluates at its end, and too little held-out text
    for ``logging.eval_batches`` skips evaluation with a message. Returns the lines."""
    said = []
    o = cfg.optim
    if "optim.warmup_steps" not in explicit and o.warmup_steps > o.max_steps:
        was, o.warmup_steps = o.warmup_steps, o.max_steps // 10
        said.append(f"optim.warmup_steps = {o.warmup_steps}: adapted, its default {was} is more than "
                    f"optim.max_steps = {o.max_steps} (a tenth of the run)")
    return said


def _get(cfg: TrainConfig, name: str):
    obj = cfg
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: TrainConfig) -> None:
    """Every check of the settings alone (no machine, no process group): types were checked
    when they were set; here ranges, choices and the settings against each other. The first
    failing rule raises one ``SpmdError`` naming the setting and the fix."""
    import math

    m, d, o = cfg.model, cfg.data, cfg.optim
    if cfg.mesh.devices < 0:
        raise SpmdError(f"mesh.devices = {cfg.mesh.devices}: give the number of devices (processes), "
                        f"or 0 for every CUDA device (else 2 CPU processes)")
    for name, low, high, what in _RANGES:
        v = _get(cfg, name)
        if isinstance(v, float) and not math.isfinite(v):
            raise SpmdError(f"{name} = {v}: give a finite number ({what})")
        if v < low or (high is not None and v > high):
            bound = f"at least {low}" if high is None else f"between {low} and {high}"
            raise SpmdError(f"{name} = {v}: must be {bound} ({what})")
    if not (math.isfinite(o.lr) and o.lr > 0):
        raise SpmdError(f"optim.lr = {o.lr}: give a positive learning rate (e.g. 3e-4)")
    for name, v in (("optim.beta1", o.beta1), ("optim.beta2", o.beta2)):
        if not 0 <= v < 1:
            raise SpmdError(f"{name} = {v}: AdamW's betas are in [0, 1) (usual: beta1 0.9, beta2 0.95-0.999)")
    if not 0 <= m.dropout < 1:
        raise SpmdError(f"model.dropout = {m.dropout}: give a probability in [0, 1)")
    if o.warmup_steps > o.max_steps:
        raise SpmdError(f"optim.warmup_steps = {o.warmup_steps} is more than optim.max_steps = {o.max_steps}: the "
                        f"learning rate would never reach its peak; lower optim.warmup_steps or raise optim.max_steps")
    if not 0 <= d.eval_fraction < 0.5:
        raise SpmdError(f"data.eval_fraction = {d.eval_fraction}: choose a value in [0, 0.5) (0: no evaluation)")
    if cfg.precision.dtype not in ("fp32", "bf16"):
        raise SpmdError(f"precision.dtype = {cfg.precision.dtype!r}: choose 'fp32' or 'bf16'"
                        + did_you_mean(cfg.precision.dtype, ["fp32", "bf16"]))
    if o.batch_size % o.grad_accum:
        raise SpmdError(f"optim.batch_size = {o.batch_size} is not divisible by optim.grad_accum = {o.grad_accum}; "
                        f"choose a batch size that is a multiple of it")
    if not m.pretrained:
        _check_model_name(m.name)
        if m.dim % m.num_heads:
            raise SpmdError(f"model.dim = {m.dim} is not divisible by model.num_heads = {m.num_heads}")
        if m.name == "seed" and m.num_kv_heads not in (0, m.num_heads):
            raise SpmdError(f"model.num_kv_heads = {m.num_kv_heads}: the seed decoder has as many key/value heads as "
                            f"attention heads; leave it 0, or use model.name = 'llama' for grouped-query attention")
        if m.num_kv_heads and m.num_heads % m.num_kv_heads:
            raise SpmdError(f"model.num_heads = {m.num_heads} is not divisible by model.num_kv_heads = "
                            f"{m.num_kv_heads}; choose a divisor of it (0: as many as attention heads)")
        if d.seq_len > m.max_seq_len:
            raise SpmdError(
                f"data.seq_len = {d.seq_len} is beyond the model's positions (model.max_seq_len = {m.max_seq_len}); "
                f"lower data.seq_len or raise model.max_seq_len"
            )
    elif not Path(m.pretrained).is_dir():
        raise SpmdError(f"model.pretrained = {m.pretrained!r}: no such directory")
    elif m.vocab_size:
        raise SpmdError(f"model.vocab_size = {m.vocab_size} with model.pretrained = {m.pretrained!r}: a pretrained "
                        f"model keeps its own vocabulary; set model.vocab_size = 0")
    if d.path and not Path(d.path).exists():
        raise SpmdError(f"data.path = {d.path!r}: no such file or directory")
    if d.tokenizer != "byte" and not Path(d.tokenizer).exists():
        raise SpmdError(f"data.tokenizer = {d.tokenizer!r}: no such file or directory; give 'byte' or a local "
                        f"tokenizer.json / transformers tokenizer directory")
    _check_pipeline(cfg)
    r = cfg.checkpoint.resume
    if r not in ("auto", "none") and not Path(r).is_dir():
        what = "a file, not a checkpoint directory" if Path(r).exists() else "no such checkpoint directory"
        raise SpmdError(f"checkpoint.resume = {r!r}: {what}; give a step-NNNNNNNN directory "
                        f"under a job's out_dir/checkpoints, 'auto' (the newest in out_dir, if any) or 'none'")


def _check_backend(cfg: TrainConfig) -> str:
    """The backend the job will use; a ``mesh.backend`` this machine cannot run is an error
    naming the setting."""

    from torchspmd import accelerators

    b = cfg.mesh.backend.lower()
    if b and not runtime.known_backend(b):
        raise SpmdError(f"mesh.backend = {cfg.mesh.backend!r}: unknown backend; choose one of "
                        f"{', '.join(repr(x) for x in runtime.backends())}, a device type PyTorch has a module for, "
                        f"or leave it empty to pick one")
    # (a device type PyTorch has a module for; torch_xla's device has none: its engine checks it)
    if b and accelerators.device_module(b) is not None and not accelerators.is_available(b):
        raise SpmdError(f"mesh.backend = {b!r}: no {b} device is visible to PyTorch "
                        f"(torch.get_device_module({b!r}).is_available() is False); set mesh.backend = 'cpu' or "
                        f"leave it empty")
    return runtime.chosen_backend(b or None)


def device_count(cfg: TrainConfig) -> int | None:
    """The devices the job asks ``use_spmd`` for: ``mesh.devices``, else 2 CPU processes
    unless the environment says (``$TORCHSPMD_NUM_DEVICES``, ``$CPU_NUM_DEVICES``), the
    backend is an accelerator (every device) or the engine counts its own (torch_xla)."""
    import os

    from torchspmd import accelerators

    if cfg.mesh.devices:
        return cfg.mesh.devices
    if runtime.planned_processes(cfg.mesh.backend or None) is None:
        return None
    if os.environ.get(runtime.ENV_NUM_DEVICES) or os.environ.get(runtime.XLA_CPU_NUM_DEVICES):
        return None
    backend = cfg.mesh.backend or accelerators.default_type()
    return None if backend != accelerators.CPU else 2


def planned_devices(cfg: TrainConfig) -> int | None:
    """The number of devices (processes) the job will run on, known before any worker
    starts: ``WORLD_SIZE`` under a launcher, else what ``use_spmd`` will be given
    (``mesh.devices``, ``$TORCHSPMD_NUM_DEVICES``, the CUDA devices, 2 CPU processes).
    None on the torch_xla engine, which counts its devices when it starts."""

    return runtime.planned_processes(_check_backend(cfg), device_count(cfg))


def preflight(cfg: TrainConfig) -> None:
    """Checks that need the machine or the data, made where the job starts, before any
    worker process exists, so that a bad setting is one error, printed once: the backend
    and device count against ``mesh.*`` and the batch size, a pretrained model against the
    tokenizer and ``data.seq_len``, and the corpus against one batch. The corpus is
    tokenized here, into ``out_dir/cache`` (the workers map that file). Under a launcher
    (torchrun, ``torchspmd run``) every process checks the settings and the job's rank 0
    reads the corpus (``train.loop``)."""

    world = planned_devices(cfg)
    if world is not None:
        mesh_checks(cfg, world)
    tokenizer = tdata.make_tokenizer(cfg.data.tokenizer)
    if cfg.model.pretrained:
        _check_pretrained(cfg, tokenizer)
    else:

        model_vocab(cfg.model, tokenizer)
    if not runtime.launched():
        tokens = tdata.load_tokens(cfg.data, tokenizer, Path(cfg.out_dir) / "cache")
        tdata.check_corpus(len(tokens), cfg.data, cfg.optim)


PIPELINE_SCHEDULES = tuple(SCHEDULES)


def _check_pipeline(cfg: TrainConfig) -> None:
    """The pipeline settings alone: a known schedule; with stages, none of the settings that
    do not combine with them yet."""
    if cfg.pipeline.schedule not in PIPELINE_SCHEDULES:
        raise SpmdError(f"pipeline.schedule = {cfg.pipeline.schedule!r}: choose one of "
                        f"{', '.join(PIPELINE_SCHEDULES)}" + did_you_mean(cfg.pipeline.schedule, PIPELINE_SCHEDULES))
    if cfg.mesh.pipeline == 1:
        return
    refused = [(cfg.mesh.data > 1, "mesh.data", cfg.mesh.data, "a 'data' axis beside the stages"),
               (cfg.precision.dtype != "fp32", "precision.dtype", cfg.precision.dtype, "bf16 stages"),
               (cfg.precision.checkpointing, "precision.checkpointing", True, "activation checkpointing in a stage"),
               (cfg.compile, "compile", True, "compiled stages"),
               (cfg.model.meta_init, "model.meta_init", True, "stages of a model built on meta")]
    for bad, name, value, what in refused:
        if bad:
            raise SpmdError(f"{name} = {_toml_value(value)} with mesh.pipeline = {cfg.mesh.pipeline}: {what} is not "
                            f"available yet; leave {name} at its default, or set mesh.pipeline = 1")


def stages_per_process(schedule: str) -> int:
    """The stages each process of the pipeline axis runs under ``schedule``."""
    return 2 if schedule in ("interleaved-1f1b", "zero-bubble") else 1


def bubble(p: int, schedule: str, m: int) -> float:
    """The schedule's idle share by its formula, ``(p - 1) / (v m + p - 1)`` for ``p``
    processes along the axis, ``v`` stages each, ``m`` micro-batches."""
    return (p - 1) / (stages_per_process(schedule) * m + p - 1)


def allowed_microbatches(rows: int, p: int, schedule: str) -> list[int]:
    """The micro-batch counts ``rows`` rows split into and ``schedule`` over ``p``
    processes takes (1f1b: one per stage at least; the two-stage schedules: a multiple of ``p``)."""
    v = stages_per_process(schedule)
    return [m for m in range(1, rows + 1)
            if rows % m == 0 and (schedule != "1f1b" or m >= p) and (v == 1 or m % p == 0)]


def fewest_microbatches(rows: int, p: int, schedule: str) -> int | None:
    """The fewest allowed micro-batches whose bubble is at most 25% (else the most allowed);
    None when none is allowed."""
    fits = allowed_microbatches(rows, p, schedule)
    return next((m for m in fits if bubble(p, schedule, m) <= 0.25), fits[-1]) if fits else None


def pipeline_microbatches(cfg: TrainConfig, world: int) -> tuple[int, float]:
    """With ``mesh.pipeline`` stages: the micro-batches each micro-step's batch is split into
    (``pipeline.microbatches``, else :func:`fewest_microbatches`) and the bubble."""
    p, schedule = cfg.mesh.pipeline, cfg.pipeline.schedule
    fsdp = world // (p * cfg.mesh.model)  # (a stage's 'model' processes take the same rows)
    rows = cfg.optim.batch_size // cfg.optim.grad_accum // fsdp  # one process's rows per micro-step
    fits = allowed_microbatches(rows, p, schedule)
    need = {"1f1b": f"at least {p} (one per stage)", "gpipe": "any number"}.get(schedule, f"a multiple of {p}")
    if cfg.pipeline.microbatches:
        m = cfg.pipeline.microbatches
        if m not in fits:
            raise SpmdError(f"pipeline.microbatches = {m}: each process's {rows} rows per micro-step (optim.batch_size"
                            f" / optim.grad_accum / the {fsdp} 'fsdp' processes of a stage) must split into it, "
                            f"and the {schedule} schedule needs {need}; choose one of "
                            f"{', '.join(str(k) for k in fits) or 'none (raise optim.batch_size)'}")
        return m, bubble(p, schedule, m)
    m = fewest_microbatches(rows, p, schedule)
    if m is None:
        raise SpmdError(f"mesh.pipeline = {p}: each process's {rows} rows per micro-step cannot be split into "
                        f"micro-batches the {schedule} schedule takes ({need}); raise optim.batch_size "
                        f"or lower optim.grad_accum")
    return m, bubble(p, schedule, m)


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
    if world % cfg.mesh.pipeline:
        raise SpmdError(f"mesh.pipeline = {cfg.mesh.pipeline} does not divide the {world} devices; choose one of "
                        f"{', '.join(map(str, divisors))} (1: no stages)")
    if cfg.mesh.context > 1:
        if cfg.mesh.model > 1 or cfg.mesh.pipeline > 1:
            other = "mesh.model" if cfg.mesh.model > 1 else "mesh.pipeline"
            raise SpmdError(f"mesh.context = {cfg.mesh.context} with {other} > 1: a sequence split over 'context' does "
                            f"not combine with tensor parallelism or stages yet; set {other} = 1 or mesh.context = 1")
        if world % (cfg.mesh.data * cfg.mesh.context):
            fits = [k for k in divisors if (world // cfg.mesh.data) % k == 0]
            raise SpmdError(f"mesh.context = {cfg.mesh.context} does not divide the {world // cfg.mesh.data} devices "
                            f"left by mesh.data = {cfg.mesh.data}; choose one of {', '.join(map(str, fits))} "
                            f"(1: no sequence split)")
    dp = world // (cfg.mesh.model * cfg.mesh.pipeline * cfg.mesh.context)
    if micro % dp:
        raise SpmdError(f"the micro-batch of {micro} sequences (optim.batch_size / optim.grad_accum) is not "
                        f"divisible by the {dp} data-parallel devices; use a multiple of {dp}")
    if cfg.mesh.pipeline > 1:
        pipeline_microbatches(cfg, world)


def _check_pretrained(cfg: TrainConfig, tokenizer) -> None:

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
