"""distckpt.train needs torch only: the loop runs with Hydra, tqdm, wandb, TensorBoard, scikit-learn and
transformers made unimportable."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from launchkit import ROOT, env

SCRIPT = textwrap.dedent("""
    import sys

    BLOCKED = ("hydra", "omegaconf", "tqdm", "wandb", "tensorboard", "sklearn", "transformers", "launch")

    for name in BLOCKED:
        sys.modules[name] = None  # `import name` now raises ImportError; find_spec() says "not there"
    import torch
    import distckpt
    from distckpt.train import LoopOptions, MetricSink, TrainState, fit
    from distckpt.train.data import ShardedLoader, synthetic_tokens
    from distckpt.train.models import MultiTaskGPT

    torch.manual_seed(0)
    model = distckpt.wrap(MultiTaskGPT(d_model=32, n_layer=2, n_head=2, seq_len=16), "full")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = TrainState(model, opt)
    run = sys.argv[1]
    sink = MetricSink(run)
    data = ShardedLoader(synthetic_tokens(64, 16, 64, 4), 8)
    res = fit(model, state, data, opts=LoopOptions(max_steps=3, log_every=1, progress=True),
              run_dir=run, sink=sink, device=torch.device("cpu"))
    sink.close()
    assert res.step == 3 and res.checkpoints[-1].endswith("step_3"), res
    assert not [m for m, mod in sys.modules.items() if m.split(".")[0] in BLOCKED and mod is not None]
    print("ok", res.losses["loss"])
""")


def test_training_loop_runs_with_torch_alone(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "run")],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok ")
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3
