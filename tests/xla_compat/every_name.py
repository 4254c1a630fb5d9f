"""Every module and name of torch_xla's manifest under --xla-compat, run by tests/test_xla_compat.py
as ``python -m torchspmd.compat every_name.py OUT_JSON`` (one process): each module imports, each
name imports (``from m import name``) and is the object ``m.name`` gives; a stand-in fails when it
is used, with NotProvidedError naming its API; a constant is torch_xla's value; a name or module
torch_xla lacks raises what torch_xla would. Then ``init_process_group('xla', init_method=
'xla://')`` before ``xr.use_spmd()`` (one process, no launcher). Writes what it saw as JSON."""

import importlib
import json
import sys

import torch.distributed as dist

from torchspmd.compat import manifest, stand_ins

out = {"modules": 0, "names": 0, "import_failures": [], "same_object": [], "use": {}, "constants": [],
       "kinds": {}}


def use(value):
    """Use a stand-in as a program would: call it, make one, read an attribute."""
    if isinstance(value, type):
        errors = []
        for action in (lambda: value(), lambda: type("Sub", (value,), {})(), lambda: value.some_attribute):
            try:
                action()
            except Exception as e:  # noqa: BLE001
                errors.append([type(e).__name__, str(e)])
            else:
                errors.append(None)
        errors.append(isinstance(object(), value))
        return errors
    try:
        value()
    except Exception as e:  # noqa: BLE001
        return [[type(e).__name__, str(e)]]
    return [None]


for module in manifest.modules():
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001
        out["import_failures"].append([module, f"{type(e).__name__}: {e}"])
        continue
    out["modules"] += 1
    for name, entry in manifest.names(module).items():
        api = f"{module}.{name}"
        try:
            scope: dict = {}
            exec(f"from {module} import {name} as imported", scope)
            value = getattr(mod, name)
        except Exception as e:  # noqa: BLE001
            out["import_failures"].append([api, f"{type(e).__name__}: {e}"])
            continue
        out["names"] += 1
        if scope["imported"] is not value:
            out["same_object"].append(api)
        if entry.kind == "constant":
            if not (value == entry.value or value != value):  # (nan)
                out["constants"].append([api, repr(value), repr(entry.value)])
            continue
        if stand_ins.api_of(value) is not None:
            out["kinds"][api] = entry.kind
            out["use"][api] = [stand_ins.api_of(value), use(value)]

# what torch_xla lacks: the errors torch_xla gives
lacking = {}
for what, code in {
    "name": "import torch_xla.core.xla_model as xm; xm.no_such_name",
    "from": "from torch_xla.core.xla_model import no_such_name",
    "module": "import torch_xla.no_such_module",
    "private module's name used": "from torch_xla._internal import tpu; tpu.version()",
    "private module's dunder": "from torch_xla._internal import tpu; tpu.__no_such__",
    "private _XLAC name": "import torch_xla; torch_xla._XLAC._xla_no_such_function",
}.items():
    try:
        exec(code, {})
    except Exception as e:  # noqa: BLE001
        lacking[what] = [type(e).__name__, isinstance(e, ImportError), isinstance(e, AttributeError), str(e)]
    else:
        lacking[what] = None
out["lacking"] = lacking

# constant modules as they are
import torch_xla.core.xla_env_vars as xenv  # noqa: E402

out["xenv"] = [xenv.PJRT_DEVICE, xenv.TPU_MESH_CTLER_ADDR, xenv.CPU_NUM_DEVICES]

# init_process_group('xla', init_method='xla://') before use_spmd(): one process, no launcher
import torch_xla.distributed.xla_backend  # noqa: E402,F401
import torch_xla.runtime as xr  # noqa: E402

dist.init_process_group("xla", init_method="xla://")
first = [dist.get_backend(), dist.get_world_size(), dist.get_rank()]
xr.use_spmd()
dist.init_process_group("gloo", init_method="xla://")  # again: the same group
out["process_group"] = first + [dist.get_backend(), dist.get_world_size()]

with open(sys.argv[1], "w") as f:
    json.dump(out, f)
