"""A device plugin that would abort ``import torch`` (torch-tpu without libtpu) is named by
``import torchspmd`` with what to do, instead of the process dying in torch's plugin autoload;
a backend no plugin registered says which plugins are installed. The plugin is a stand-in: a
distribution whose ``torch.backends`` entry point names ``torch_tpu``, as torch-tpu's does (the
real wheel's C++ part aborts the process without libtpu; it needs TPU hardware to register
its device)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _plugin(root: Path) -> Path:
    info = root / "torch_tpu-0.2.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch-tpu\nVersion: 0.2.0\n")
    (info / "entry_points.txt").write_text("[torch.backends]\ntorch_tpu = torch_tpu._loader:load\n")
    package = root / "torch_tpu"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_loader.py").write_text("def load():\n    pass  # (registers nothing: no TPU here)\n")
    return root


def _run(code: str, root: Path, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("TPU_LIBRARY_PATH", "TORCH_DEVICE_BACKEND_AUTOLOAD",
                                                              "TORCHSPMD_BACKEND")}
    full.update(PYTHONPATH=os.pathsep.join([str(root), str(REPO)]), **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True,
                          timeout=120)


def test_torch_tpu_without_libtpu_is_named_before_torch_is_imported(tmp_path):
    root = _plugin(tmp_path)
    out = _run("import torchspmd", root)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: torchspmd: torch-tpu is installed but libtpu is not"), out.stderr
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in last and "libtpu>=0.0.50" in last
    probe = "import sys, torchspmd; print('torch' in sys.modules)"
    # what the message offers works: the autoload off, or libtpu there (the plugin then loads)
    for env in (dict(TORCH_DEVICE_BACKEND_AUTOLOAD="0"), dict(TPU_LIBRARY_PATH=str(tmp_path / "libtpu.so"))):
        out = _run(probe, root, **env)
        assert out.returncode == 0 and out.stdout.split() == ["True"], (env, out.stderr)
    # and without the plugin nothing is said
    out = _run(probe, tmp_path / "empty")
    assert out.returncode == 0, out.stderr


def test_a_backend_no_plugin_registered_names_the_installed_plugins(tmp_path):
    root = _plugin(tmp_path)
    code = """
        import torchspmd as ts
        try:
            ts.use_spmd()
        except ts.SpmdError as e:
            print(e)
    """
    out = _run(code, root, TORCHSPMD_BACKEND="tpu", TPU_LIBRARY_PATH="libtpu.so")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("TORCHSPMD_BACKEND=tpu: unknown backend"), out.stdout
    assert ("the device plugins installed (torch_tpu = torch_tpu._loader:load) registered no 'tpu' device"
            in out.stdout and "only on a machine with a TPU chip" in out.stdout)
    out = _run(code, root, TORCHSPMD_BACKEND="tpu", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert "(torch_tpu = torch_tpu._loader:load) are not loaded (TORCH_DEVICE_BACKEND_AUTOLOAD=0)" in out.stdout, out
