"""The test environments, built from committed lock files so that CI is reproducible.

    python3 .ci/envs.py python NAME     build or sync environment NAME from .ci/lock/NAME.txt; print its python
    python3 .ci/envs.py check NAME PY   fail if PY's installed packages differ from .ci/lock/NAME.txt
    python3 .ci/envs.py newest NAME     environment NAME with the newest releases the package's ranges admit
                                        (torch as pinned below); print its python, report what differs from the lock
    python3 .ci/envs.py freeze PY       print PY's packages as a lock (exact versions, torchspmd left out)

NAME is one of:
  native      torch 2.13 (CPU build) + the [test] extra: the whole suite. It is the clone's .venv (README's
              test command installs it with ``-c .ci/lock/native.txt``); ``python`` does not build it.
  xla         torch 2.9 + torch_xla 2.9 + the [test] extra: tests/xla (the XLA engine).
  torch-2.14  the newest torch installable here + the [test] extra: the smoke subset (``-m smoke``).

The xla and torch-2.14 environments live outside the clone ($TORCHSPMD_ENV_CACHE, default
~/.cache/torchspmd; several GB each with torch's CUDA libraries), so that a machine downloads them
once. An environment is synced to its lock when the lock changes: packages are installed at the
locked versions (``--no-deps``: the lock lists every package) and packages the lock does not list
are removed. torchspmd itself is not installed there: tests run with PYTHONPATH=<the clone>.
A newest-versions environment is kept beside it (NAME-newest) and upgraded on every call.

.ci/lock-refresh resolves new locks, runs the tests on them and commits them.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCKS = ROOT / ".ci" / "lock"
TORCH = {"native": ["torch==2.13.0"], "xla": ["torch==2.9.0", "torch_xla==2.9.0"], "torch-2.14": ["torch==2.14.1"]}
EXTRA = "test"


def cache() -> Path:
    return Path(os.environ.get("TORCHSPMD_ENV_CACHE") or Path(os.environ.get("HOME", "/root")) / ".cache" / "torchspmd")


def say(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, stdout=sys.stderr)


def requirements() -> list[str]:
    """The package's requirements with the [test] extra (torch left out: TORCH pins it)."""
    out = subprocess.run([sys.executable, str(ROOT / ".ci" / "requirements.py"), EXTRA], check=True,
                         capture_output=True, text=True).stdout
    return out.split()


def read_lock(name: str) -> dict[str, str]:
    """{normalized name: 'name==version'} of a lock file."""
    path = LOCKS / f"{name}.txt"
    if not path.is_file():
        raise SystemExit(f"envs.py: no lock file {path.relative_to(ROOT)}; run .ci/lock-refresh")
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            pins[normalize(line.split("==")[0])] = line
    return pins


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def freeze(python: str) -> dict[str, str]:
    out = subprocess.run([python, "-m", "pip", "list", "--format=freeze", "--exclude-editable",
                          "--disable-pip-version-check"], check=True, capture_output=True, text=True).stdout
    pins = {}
    for line in out.splitlines():
        if "==" in line:
            name = normalize(line.split("==")[0])
            if name not in ("torchspmd", "pip", "setuptools", "wheel"):
                pins[name] = line.strip()
    return pins


def differences(have: dict[str, str], want: dict[str, str]) -> list[str]:
    out = []
    for name in sorted(set(have) | set(want)):
        a, b = have.get(name), want.get(name)
        if a != b:
            out.append(f"  {name}: {a.split('==')[1] if a else 'absent'} (lock: {b.split('==')[1] if b else 'absent'})")
    return out


def check(name: str, python: str) -> None:
    diff = differences(freeze(python), read_lock(name))
    if diff:
        raise SystemExit(f"envs.py: the {name} environment ({python}) differs from .ci/lock/{name}.txt:\n"
                         + "\n".join(diff) + "\nthe lock is stale (a requirement changed): run .ci/lock-refresh")


def venv(path: Path, clear: bool) -> str:
    python = str(path / "bin" / "python")
    if clear or not Path(python).exists():
        run(sys.executable, "-m", "venv", "--clear", str(path))
    return python


def importable(python: str, name: str) -> bool:
    modules = {"xla": "torch_xla", "torch-2.14": "torch", "native": "torch"}
    return subprocess.run([python, "-c", f"import {modules[name]}"], capture_output=True).returncode == 0


def locked(name: str) -> str:
    """Environment NAME, synced to its lock."""
    path = cache() / f"{name}-venv"
    lock = LOCKS / f"{name}.txt"
    want = read_lock(name)
    stamp = path / ".torchspmd-lock"
    digest = hashlib.sha256(lock.read_bytes()).hexdigest()
    python = str(path / "bin" / "python")
    works = Path(python).exists() and importable(python, name)
    if works and stamp.is_file() and stamp.read_text() == digest:
        return python
    say(f"syncing the {name} environment in {path} to {lock.relative_to(ROOT)} (first time: several GB)")
    python = venv(path, clear=not works)
    stamp.unlink(missing_ok=True)
    run(python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "-r", str(lock))
    extra = sorted(set(freeze(python)) - set(want))
    if extra:
        run(python, "-m", "pip", "uninstall", "-q", "-y", *extra)
    check(name, python)
    if not importable(python, name):
        raise SystemExit(f"envs.py: the {name} environment does not import after installing {lock}")
    stamp.write_text(digest)
    return python


def newest(name: str) -> str:
    """Environment NAME-newest: what a fresh unpinned install gets today (torch pinned)."""
    path = cache() / f"{name}-newest-venv"
    python = str(path / "bin" / "python")
    python = venv(path, clear=not (Path(python).exists() and importable(python, name)))
    run(python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--upgrade", "--upgrade-strategy",
        "eager", *TORCH[name], *requirements())
    diff = differences(freeze(python), read_lock(name)) if (LOCKS / f"{name}.txt").is_file() else []
    say(f"newest versions for {name}: " + ("the lock's" if not diff else "differ from the lock:\n" + "\n".join(diff)))
    return python


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] not in ("python", "check", "newest", "freeze"):
        raise SystemExit(__doc__)
    verb, arg = argv[0], argv[1]
    if verb == "freeze":
        print("\n".join(sorted(freeze(arg).values(), key=str.lower)))
        return
    if arg not in TORCH:
        raise SystemExit(f"envs.py: unknown environment {arg!r}; one of {', '.join(TORCH)}")
    if verb == "check":
        check(arg, argv[2])
    elif verb == "python":
        if arg == "native":
            raise SystemExit("envs.py: the native environment is the clone's .venv (see the README's test command)")
        print(locked(arg))
    else:
        print(newest(arg))


if __name__ == "__main__":
    main(sys.argv[1:])
