"""The ``torchspmd`` command: ``train``, ``explain``, ``export``, ``generate``, ``run``, ``info``
and ``plan``."""

from __future__ import annotations

import argparse
import os
import sys

from torchspmd import accelerators, engines, patches, runtime
from torchspmd.launch import launcher
from torchspmd.launch.failures import interrupted, record_error
from torchspmd.launch.environment import all_ranks_output, parse_count
from torchspmd.errors import SpmdError
from torchspmd.version import __version__


def _pop_nproc(argv: list[str]) -> tuple[int | None, list[str]]:
    """Take ``--nproc N`` / ``--nproc=N`` out of the options before the script."""
    out, nproc, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if not a.startswith("-"):
            out.extend(argv[i:])
            break
        if a == "--nproc":
            if i + 1 >= len(argv):
                raise SpmdError("torchspmd run: --nproc needs a number")
            nproc = _count(argv[i + 1])
            i += 2
            continue
        if a.startswith("--nproc="):
            nproc = _count(a.split("=", 1)[1])
        else:
            out.append(a)
        i += 1
    return nproc, out


def _count(text: str) -> int:

    return parse_count(text, "torchspmd run --nproc")


def cmd_run(argv: list[str]) -> int:

    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: torchspmd run [--nproc N] [--xla-compat] [torchrun options] script.py [args...]\n\n"
            "Start script.py once per device (N processes on this host; default:\n"
            "$TORCHSPMD_NUM_DEVICES, else every CUDA device, else $CPU_NUM_DEVICES, else 1). Every torchrun\n"
            "option works (--nnodes, --rdzv-endpoint, --max-restarts, ...) for multi-host runs.\n"
            "--xla-compat: run a torch_xla SPMD program unchanged (`import torch_xla` resolves\n"
            "to torchspmd; docs/xla_compat.md)."
        )
        return 0
    nproc, rest = _pop_nproc(argv)
    compat = "--xla-compat" in rest[:_script_index(rest) + 1]  # (an option of ours, before the program)
    if compat:
        rest.remove("--xla-compat")
    if nproc is None and not any(a.startswith("--nproc-per-node") or a.startswith("--nproc_per_node") for a in rest):
        # Under --xla-compat the program runs on the native engine whatever PJRT_DEVICE says.
        backend = accelerators.default_type() if compat else runtime.chosen_backend(None)
        nproc = runtime.planned_processes(backend) or 1
    if not any(not a.startswith("-") for a in rest):
        raise SpmdError("torchspmd run: name the script to run, e.g. `torchspmd run --nproc 2 train.py`")
    _check_script(rest)
    if compat:
        rest = _under_compat(rest)
    return launcher.launch(rest, nproc)


def _script_index(args: list[str]) -> int:
    """Where the program (script or module) starts in torchrun's arguments."""
    import contextlib
    import io

    from torch.distributed.run import get_args_parser

    args = [a for a in args if a != "--xla-compat"]
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parsed = get_args_parser().parse_args(args)
    except SystemExit:
        return len(args)
    return len(args) - len(parsed.training_script_args) - 1


def _check_script(args: list[str]) -> None:
    """A script that does not exist or does not compile fails here, once, before any
    worker starts (a module run with -m is left to Python)."""
    i = _script_index(args)
    if any(o in ("-m", "--module", "--no-python", "--no_python") for o in args[:i]):
        return
    path = args[i]
    if not os.path.isfile(path):
        raise SpmdError(f"torchspmd run: no such script: {path!r} (from {os.getcwd()})")
    try:
        with open(path, "rb") as f:
            compile(f.read(), path, "exec", dont_inherit=True)
    except SyntaxError as e:
        where = f"{e.filename}, line {e.lineno}" if e.lineno else str(e.filename)
        text = f"\n    {e.text.rstrip()}" if e.text else ""
        raise SpmdError(f"torchspmd run: {type(e).__name__} in the script ({where}): {e.msg}{text}") from None


def _under_compat(args: list[str]) -> list[str]:
    """torchrun's arguments starting the program as ``python -m torchspmd.compat <program>``."""
    i = _script_index(args)
    opts, program = args[:i], args[i:]
    module = [o for o in opts if o in ("-m", "--module")]
    opts = [o for o in opts if o not in ("-m", "--module")]
    return [*opts, "-m", "torchspmd.compat", *(["-m"] if module else []), *program]


def cmd_info(argv: list[str]) -> int:
    """Versions, the engine a program would start here, and the patches it applies
    (started here on one device to list them)."""
    argparse.ArgumentParser(prog="torchspmd info",
                            description="Print the versions of torchspmd and torch, the engine and backend a program "
                                        "would start here, its devices, and the patches use_spmd() applies to other "
                                        "libraries (and those it leaves out, with why). Takes no options.").parse_args(argv)
    import torch

    engine, backend = engines.choose(None)
    print(f"torchspmd {__version__}")
    print(f"torch {torch.__version__}")
    print(f"engine (default) {engine.name}, backend {backend}")
    for line in engine.describe(backend):
        print(line)
    accelerator = accelerators.current()
    print(f"accelerator {accelerator or 'none'}"
          + (f" ({accelerators.device_count(accelerator)} devices)" if accelerator else ""))
    print(f"torch_xla installed {engines.xla_installed()}")
    runtime.use_spmd(num_devices=1) if engine.capabilities.process_per_device else runtime.use_spmd()
    active = patches.active()
    print(f"patches applied by use_spmd() ({len(active)}; docs/patches.md):")
    for patch in active:
        print(f"  {patch.name} [{patch.library} {patches.version(patch.library)}; verified on "
              f"{patch.library}{patch.versions}]")
    left_out = patches.skipped()
    if left_out:
        print(f"patches left out ({len(left_out)}):")
        for patch, why in left_out:
            print(f"  {patch.name}: {why}")
    return 0


def cmd_train(argv: list[str]) -> int:
    from torchspmd.train import PRESETS, from_args, run

    cfg, ns = from_args(argv)
    if ns.list_presets:
        from torchspmd.train.config import PRESET_TARGETS

        for name, over in PRESETS.items():
            print(f"{name}: {over or '(the defaults)'}\n    meant for {PRESET_TARGETS[name].hardware}")
        return 0
    if ns.print_config:
        print(cfg.to_toml())
        return 0
    run(cfg)
    return 0


def cmd_explain(argv: list[str]) -> int:
    """The train job's model as ``torchspmd train`` with the same options would build and
    shard it: each parameter's layout and the collectives of one training step."""
    from torchspmd.train import from_args, run

    cfg, _ = from_args(argv, prog="torchspmd explain",
                       description="Print how `torchspmd train` with the same settings would build and shard its model: "
                                   "each parameter's layout and the collectives of one training step. Takes train's "
                                   "settings.")
    run(cfg, explain=True)
    return 0


def cmd_export(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="torchspmd export",
                                description="Write a checkpoint as a transformers directory (safetensors + config).")
    p.add_argument("checkpoint", help="a checkpoint directory, or a train output directory (its newest checkpoint)")
    p.add_argument("out", help="directory to write")
    args = p.parse_args(argv)
    from torchspmd.train.export import export

    print(f"wrote {export(args.checkpoint, args.out)}")
    return 0


def cmd_generate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="torchspmd generate", description="Sample text from a checkpoint.")
    p.add_argument("checkpoint", help="a checkpoint directory, or a train output directory")
    p.add_argument("--prompt", default="def ", help="the text to continue (default 'def ')")
    p.add_argument("--tokens", type=int, default=200, help="how many tokens to generate (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0: greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=10, help="sample among the k likeliest tokens; 1: greedy (default 10)")
    p.add_argument("--seed", type=int, default=0, help="the sampling's random seed (default 0)")
    args = p.parse_args(argv)
    from torchspmd.train.export import generate

    print(generate(args.checkpoint, args.prompt, args.tokens, args.temperature, args.top_k, args.seed))
    return 0


def cmd_plan(argv: list[str]) -> int:
    from torchspmd.train.plan import main as plan_main

    return plan_main(argv)


COMMANDS = {"train": cmd_train, "explain": cmd_explain, "export": cmd_export, "generate": cmd_generate, "run": cmd_run, "info": cmd_info,
            "plan": cmd_plan}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="torchspmd",
        description="torchspmd: SPMD sharding and FSDPv2 on PyTorch's distributed engine",
    )
    parser.add_argument("command", choices=list(COMMANDS), help="train: the training job; explain: the train job's "
                        "parameter layouts and the collectives of one step (train's options); export: a checkpoint "
                        "as a transformers directory; generate: sample from a checkpoint; run: start a script once per "
                        "device; info: versions and devices; plan: predict the peak memory per device")
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.parse_args(argv[:1] or ["--help"])
    try:
        return COMMANDS[argv[0]](argv[1:])
    except SpmdError as e:
        import torch.distributed as dist


        # Every process of a job raises the same error: rank 0 prints it, once; any other
        # process's error reaches the launcher's summary through its record. After Ctrl-C
        # (an error the interruption caused, such as a checkpoint it cut short) the job's and
        # the launcher's lines say what happened.
        if interrupted():
            raise
        if not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0
                and not all_ranks_output()):
            print(f"torchspmd: {e}", file=sys.stderr)
        record_error(e)  # in a worker: the launcher's summary names it
        return 2


if __name__ == "__main__":
    sys.exit(main())
