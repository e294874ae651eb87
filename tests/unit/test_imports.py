"""The library imports with torch alone, and its public API is the one the README's API table lists."""

import inspect
import subprocess
import sys

import distckpt

BLOCKED = [
    "hydra",
    "omegaconf",
    "wandb",
    "tensorboard",
    "matplotlib",
    "transformers",
    "tqdm",
    "sklearn",
    "numpy",
    "lightning",
    "pytorch_lightning",
    "accelerate",
    "peft",
    "deepspeed",
]


def test_library_imports_with_torch_only():
    code = (
        "import sys, importlib.abc\n"
        f"blocked = {BLOCKED!r}\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in blocked: raise ModuleNotFoundError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import distckpt, distckpt.apply.wrap, distckpt.parallel.strategies, distckpt.check.sync_guard\n"
        "import distckpt.select.policies, distckpt.select.profile, distckpt.select.blocks\n"
        "import pkgutil, importlib\n"
        "for m in pkgutil.walk_packages(distckpt.__path__, 'distckpt.'):\n"
        # The integrations are optional extras that import their framework: imported on use only.
        "    if m.name != 'distckpt.cli' and not m.name.startswith('distckpt.integrations.'):\n"
        "        importlib.import_module(m.name)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_public_api_names_and_signatures():
    for name in [
        "wrap",
        "checkpointed",
        "parallelize",
        "ddp_kwargs",
        "preflight",
        "accumulate",
        "GradSyncGuard",
        "verify_recompute",
        "ConfigError",
        "GradDesyncError",
        "RecomputeMismatchError",
    ]:
        assert hasattr(distckpt, name), name
    assert issubclass(distckpt.ConfigError, ValueError)
    assert issubclass(distckpt.GradDesyncError, RuntimeError)
    assert issubclass(distckpt.RecomputeMismatchError, RuntimeError)
    sig = inspect.signature(distckpt.wrap)
    assert list(sig.parameters) == [
        "model",
        "policy",
        "blocks",
        "reentrant",
        "preserve_rng_state",
        "offload",
        "example_inputs",
    ]
    assert sig.parameters["policy"].default == "full" and sig.parameters["reentrant"].default is False
    sig = inspect.signature(distckpt.parallelize)
    assert list(sig.parameters)[:4] == ["model", "strategy", "graph", "device_mesh"]
    assert sig.parameters["strategy"].default == "ddp" and sig.parameters["graph"].default == "auto"
    assert inspect.signature(distckpt.ddp_kwargs).parameters["graph"].default == "auto"
