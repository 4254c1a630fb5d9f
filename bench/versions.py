"""Two versions of torchspmd on the same benchmark, interleaved: is one slower?

    python bench/versions.py BASE [HEAD] [--rounds 5] [-- suite.py options]
    python bench/versions.py 868c091 --rounds 5 -- --models seed --nproc 2 4 --strategies fsdp2 fsdpv2

Each version is checked out in a git worktree (``BASE`` and ``HEAD`` are any git revisions;
``HEAD`` defaults to the working tree itself) and runs its own ``bench/suite.py`` with
``--repeats 1 --no-scaling`` and the options after ``--``, its own torchspmd first on
``PYTHONPATH``. The versions alternate within each round and the order flips every round
(A B, B A, ...), so that a slow stretch of the machine falls on both alike. The table gives,
per configuration, each version's tokens/s (median and min-max over the rounds) and the
per-round ratio HEAD / BASE (median and min-max): a ratio whose range straddles 1 is no
difference. Writes ``versions.md`` and ``versions.json`` under ``--out``
(default ``bench/results/versions``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _tree(rev: str | None, scratch: Path) -> Path:
    """The source tree of ``rev`` (a worktree under ``scratch``), or this working tree."""
    if rev is None:
        return ROOT
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    path = scratch / f"tree-{sha}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT, check=True,
                       capture_output=True)
    return path


def _run(tree: Path, out: Path, suite_args: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run([sys.executable, str(tree / "bench" / "suite.py"), "--repeats", "1", "--no-scaling", "--out",
                    str(out), *suite_args], cwd=tree, env=env, check=True)
    rows = json.loads((out / "suite.json").read_text())["results"]
    return {f"{m} {r['strategy']} x{r['nproc']}": r["tokens_per_s"] for m, rs in rows.items() for r in rs}


def _span(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def main() -> None:
    argv = sys.argv[1:]
    suite_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base")
    p.add_argument("head", nargs="?", default=None, help="default: the working tree")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=str(HERE / "results" / "versions"))
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.gettempdir()) / "torchspmd-versions"  # worktrees and per-run results
    scratch.mkdir(exist_ok=True)
    trees = {"base": _tree(a.base, scratch), "head": _tree(a.head, scratch)}
    runs: dict[str, list[dict]] = {"base": [], "head": []}
    for r in range(a.rounds):
        for name in ("base", "head") if r % 2 == 0 else ("head", "base"):
            result = _run(trees[name], scratch / f"{name}-{r}", suite_args)
            runs[name].append(result)
            print(f"round {r + 1}/{a.rounds} {name}: " + ", ".join(f"{k} {v:.0f}" for k, v in result.items()),
                  flush=True)
    head_label = a.head or "working tree"
    from _common import provenance

    machine = provenance()
    lines = [f"# {head_label} against {a.base}", "", machine, "",
             f"`python bench/versions.py {a.base}{' ' + a.head if a.head else ''} --rounds {a.rounds} -- "
             f"{' '.join(suite_args)}`: {a.rounds} rounds, the versions alternating (order flipped every round); "
             f"tokens/s as median (min-max) over the rounds, the ratio per round.", "",
             f"| configuration | {a.base} tokens/s | {head_label} tokens/s | ratio, median (min-max) |",
             "|---|---|---|---|"]
    table = {}
    for key in runs["base"][0]:
        base = [run[key] for run in runs["base"] if key in run]
        head = [run[key] for run in runs["head"] if key in run]
        ratios = [h[key] / b[key] for b, h in zip(runs["base"], runs["head"]) if key in b and key in h]
        table[key] = {"base": base, "head": head, "ratios": ratios}
        lines.append(f"| {key} | {_span(base, '.0f')} | {_span(head, '.0f')} | {_span(ratios, '.3f')} |")
    (out / "versions.md").write_text("\n".join(lines) + "\n")
    (out / "versions.json").write_text(json.dumps({"machine": machine, "base": a.base, "head": head_label,
                                                   "rounds": a.rounds,
                                                   "suite_args": suite_args, "configurations": table}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
