"""The test environments, built from committed lock files so that CI is reproducible.

    python3 .ci/envs.py python NAME     build or sync environment NAME from .ci/lock/NAME.txt; print its python
    python3 .ci/envs.py check NAME PY   fail if PY's installed packages differ from .ci/lock/NAME.txt
    python3 .ci/envs.py newest NAME     environment NAME with the newest releases the package's ranges admit
                                        (torch as pinned below; NAME ``newest``: torch as the package's range
                                        admits); print its python, report what differs from the lock
    python3 .ci/envs.py freeze PY       print PY's packages as a lock (exact versions, no local labels such as
                                        +cpu, torchspmd left out)
    python3 .ci/envs.py upstream        print the newest releases upstream of torch and of every library a patch
                                        touches, against the package's range and the patches' verified ranges

NAME is one of:
  native      torch 2.13 + the [test] and [docs] extras: the whole suite. It is the clone's .venv (README's test
              command installs it with ``-c .ci/lock/native.txt``); ``python`` does not build it.
  xla         torch 2.9 + torch_xla 2.9 + the [test] extra: tests/xla (the XLA engine).
  torch-2.15  torch 2.15, the newest release (what an unpinned install gets) + the [test] extra: the
              smoke subset (``-m smoke``).
  newest      (``newest`` only) every requirement at its newest release, torch included: CI's report.

Some machines carry a pip constraints file that caps torch below the newest release (the wheels
on their disk): environments whose torch is above it (torch-2.15, newest) install with
PIP_CONSTRAINT=/dev/null, which lifts the cap for that command.

The xla and torch-2.15 environments live outside the clone ($TORCHSPMD_ENV_CACHE, default
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
TORCH = {"native": ["torch==2.13.0"], "xla": ["torch==2.9.0", "torch_xla==2.9.0"], "torch-2.15": ["torch==2.15.0"]}
UNCAPPED = {"torch-2.15", "newest"}  # installed without this machine's pip constraints (see above)
EXTRA = "test"
#: extras beyond EXTRA an environment installs: the native one also builds the docs site
EXTRAS = {"native": "test,docs"}


def cache() -> Path:
    return Path(os.environ.get("TORCHSPMD_ENV_CACHE") or Path(os.environ.get("HOME", "/root")) / ".cache" / "torchspmd")


def say(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def run(*cmd: str, uncapped: bool = False) -> None:
    env = dict(os.environ, PIP_CONSTRAINT="/dev/null") if uncapped else None
    subprocess.run(cmd, check=True, stdout=sys.stderr, env=env)


def torch_requirement() -> str:
    """The package's own torch requirement (pyproject.toml), e.g. ``torch>=2.9,<2.16``."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(d.replace(" ", "") for d in deps if re.match(r"torch\s*[<>=!~]", d))


def requirements(name: str = "") -> list[str]:
    """The package's requirements with the [test] extra (the native environment's: and [docs]),
    torch left out: TORCH pins it."""
    out = subprocess.run([sys.executable, str(ROOT / ".ci" / "requirements.py"), EXTRAS.get(name, EXTRA)], check=True,
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
                pins[name] = line.strip().split("+", 1)[0]  # a local label (+cpu) resolves on one machine only
    return pins


def differences(have: dict[str, str], want: dict[str, str]) -> list[str]:
    out = []
    for name in sorted(set(have) | set(want)):
        a, b = have.get(name), want.get(name)
        if a != b:
            out.append(f"  {name}: {a.split('==')[1] if a else 'absent'} (lock: {b.split('==')[1] if b else 'absent'})")
    return out


#: packages that come with torch's CUDA builds only: where the native lock (a CPU build's) has none
#: of them, a machine whose pip took the registry's CUDA build is not told its lock is stale
CUDA_ONLY = re.compile(r"(nvidia-|cuda-|triton$)")


def check(name: str, python: str) -> None:
    have, want = freeze(python), read_lock(name)
    if not any(CUDA_ONLY.match(k) for k in want):
        have = {k: v for k, v in have.items() if not CUDA_ONLY.match(k)}
    diff = differences(have, want)
    if diff:
        raise SystemExit(f"envs.py: the {name} environment ({python}) differs from .ci/lock/{name}.txt:\n"
                         + "\n".join(diff) + "\nthe lock is stale (a requirement changed): run .ci/lock-refresh")


def venv(path: Path, clear: bool) -> str:
    python = str(path / "bin" / "python")
    if clear or not Path(python).exists():
        run(sys.executable, "-m", "venv", "--clear", str(path))
    return python


def importable(python: str, name: str) -> bool:
    modules = {"xla": "torch_xla"}
    return subprocess.run([python, "-c", f"import {modules.get(name, 'torch')}"], capture_output=True).returncode == 0


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
    run(python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "-r", str(lock),
        uncapped=name in UNCAPPED)
    extra = sorted(set(freeze(python)) - set(want))
    if extra:
        run(python, "-m", "pip", "uninstall", "-q", "-y", *extra)
    check(name, python)
    if not importable(python, name):
        raise SystemExit(f"envs.py: the {name} environment does not import after installing {lock}")
    stamp.write_text(digest)
    return python


def newest(name: str) -> str:
    """Environment NAME-newest: the newest releases the package's ranges admit, torch as NAME
    pins it (``newest``: as the package's range admits: what a fresh unpinned install gets)."""
    path = cache() / ("newest-venv" if name == "newest" else f"{name}-newest-venv")
    python = str(path / "bin" / "python")
    python = venv(path, clear=not (Path(python).exists() and importable(python, name)))
    pins = [torch_requirement()] if name == "newest" else TORCH[name]
    run(python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--upgrade", "--upgrade-strategy",
        "eager", *pins, *requirements(name), uncapped=name in UNCAPPED)
    lock = "torch-2.15" if name == "newest" else name
    diff = differences(freeze(python), read_lock(lock)) if (LOCKS / f"{lock}.txt").is_file() else []
    say(f"newest versions for {name}: " + ("the lock's" if not diff else "differ from the lock:\n" + "\n".join(diff)))
    return python


def releases(package: str) -> list[str]:
    """The releases of ``package`` on the registry, newest first (no pre-releases)."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package, "--disable-pip-version-check"],
                         capture_output=True, text=True, env=dict(os.environ, PIP_CONSTRAINT="/dev/null")).stdout
    m = re.search(r"Available versions:\s*(.+)", out)
    return [v.strip() for v in m.group(1).split(",")] if m else []


def upstream() -> None:
    """Which newer releases exist upstream: torch against the package's range, and every
    library a patch touches against the verified ranges of its patches."""
    sys.path.insert(0, str(ROOT))
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    ranges: dict[str, set[str]] = {"torch": {torch_requirement()[len("torch"):]}}
    try:
        from torchspmd import patches

        for p in patches.catalogue():
            if p.library != "python":
                ranges.setdefault(p.library, set()).add(p.versions)
    except ImportError as e:  # torch is not importable by this python: the package's range alone
        say(f"(the patches' ranges are left out: {e})")
    for package, specs in sorted(ranges.items()):
        have = releases(package)
        if not have:
            print(f"{package}: the registry did not answer")
            continue
        outside = [v for v in have if not all(Version(v) in SpecifierSet(s) for s in specs)
                   and all(Version(v) > Version(w) for s in specs for w in [_lowest(s)] if w)]
        newest = have[0]
        if outside:
            print(f"{package}: {', '.join(outside)} upstream, newer than the verified range(s) "
                  f"{' and '.join(sorted(specs))}: try them with TORCHSPMD_UNTESTED_VERSIONS=1, then widen the ranges")
        else:
            print(f"{package}: the newest release upstream, {newest}, is inside {' and '.join(sorted(specs))}")


def _lowest(spec: str) -> str | None:
    m = re.search(r">=?\s*([\d.]+)", spec)
    return m.group(1) if m else None


def main(argv: list[str]) -> None:
    if argv[:1] == ["upstream"]:
        upstream()
        return
    if len(argv) < 2 or argv[0] not in ("python", "check", "newest", "freeze"):
        raise SystemExit(__doc__)
    verb, arg = argv[0], argv[1]
    if verb == "freeze":
        print("\n".join(sorted(freeze(arg).values(), key=str.lower)))
        return
    if arg not in TORCH and not (verb == "newest" and arg == "newest"):
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
