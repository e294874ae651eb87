"""Helpers for launcher tests: compose configs, run torchrun, read final parameters from a DCP checkpoint."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")

# A tiny job: a few seconds per run on 2 CPU ranks.
TINY = [
    "model.n_layer=2",
    "model.d_model=32",
    "model.n_head=2",
    "model.seq_len=16",
    "data.batch_size=8",
    "trainer=debug",
    "trainer.max_steps=6",
    "trainer.save_every=3",
    "trainer.eval_every=0",
]


def example_commands(example: str) -> list[list[str]]:
    """The shell commands of ``examples/<example>``'s docstring (continuation lines joined), split into words."""
    doc = (ROOT / "examples" / example).read_text().split('"""')[1].replace("\\\n", " ")
    return [shlex.split(line) for line in doc.splitlines() if re.match(r"\s+(torchrun|python) ", line)]


def launcher_overrides(cmd: list[str]) -> list[str]:
    """The overrides of a ``torchrun ... launch/train.py OVERRIDES`` command."""
    assert cmd[0] == "torchrun" and "launch/train.py" in cmd
    return cmd[cmd.index("launch/train.py") + 1 :]


def check_in_process(argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """What ``launch/train.py ARGV`` runs first (``check_overrides``), in this process: (exit code, stderr).

    A fresh Python, torch and Hydra per case costs seconds; the command line itself is run by a few tests
    (test_config.py, test_custom.py).
    """
    from launch.check import check_overrides

    for var in ("RANK", "WORLD_SIZE", "DISTCKPT_NPROC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    try:
        check_overrides(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def compose(overrides: list[str]):
    """The job config (without the ``hydra`` node) for ``overrides``."""
    from omegaconf import DictConfig

    from launch.check import compose as compose_all

    cfg = compose_all(overrides)
    return DictConfig({k: v for k, v in cfg.items() if k != "hydra"})


def env() -> dict[str, str]:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    e.pop("WANDB_API_KEY", None)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # not the test's own
        e.pop(k, None)
    return e


def torchrun_cmd(overrides: list[str], run_dir: Path, *, nproc: int = 2, extra: list[str] | None = None) -> list[str]:
    agent = extra or ["--standalone"]
    return [
        TORCHRUN,
        *agent,
        f"--nproc_per_node={nproc}",
        str(ROOT / "launch" / "train.py"),
        *overrides,
        f"hydra.run.dir={run_dir}",
    ]


def torchrun(
    overrides: list[str], run_dir: Path, *, nproc: int = 2, extra: list[str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run the launcher under torchrun; fail the test with its output if it fails."""
    agent = popen(torchrun_cmd(overrides, run_dir, nproc=nproc, extra=extra))
    try:
        out, err = agent.communicate(timeout=timeout)
    finally:
        kill_group(agent)
    proc = subprocess.CompletedProcess(agent.args, agent.returncode, out, err)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def train_on_ranks(rank: int, world_size: int, overrides: list[str], run_dir: str) -> str:
    """A job for the ``dist_pool`` ranks: what each torchrun worker of ``launch/train.py OVERRIDES`` runs
    (``train(cfg)`` on the job's process group, here the pool's: 2 gloo ranks with torchrun's environment), in
    ranks that are already started; this rank's stdout (rank 0's holds the run summary).

    A torchrun launch costs an agent and two fresh Pythons importing torch, Hydra and the launcher (seconds of
    CPU each); the launches themselves (torchrun, launch/train.py's entry, restarts, exit codes) are tested in
    test_torchrun.py, test_hsdp_nodes.py and test_config.py.
    """
    import io
    import logging

    from launch.run import train

    out, log = io.StringIO(), logging.getLogger("distckpt")
    level = log.level  # train() quiets ranks other than 0: not for the pool's next job
    try:
        with contextlib.redirect_stdout(out), warnings.catch_warnings():
            train(compose(overrides), run_dir=run_dir)
    finally:
        log.setLevel(level)
    return out.getvalue()


def run_script(argv: list[str]) -> str:
    """``python ARGV`` (a script of this checkout, relative to it, and its arguments) in this process, run as its
    ``__main__``; its stdout. A fresh Python would import torch or transformers again (seconds of CPU).

    Raises:
        AssertionError: the script exited with a code other than 0.
    """
    import io
    import runpy

    out, saved = io.StringIO(), sys.argv
    sys.argv = [str(a) for a in argv]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
    except SystemExit as e:
        assert e.code in (None, 0), f"python {' '.join(map(str, argv))} exited {e.code}"
    finally:
        sys.argv = saved
    return out.getvalue()


def popen(cmd: list[str]) -> subprocess.Popen:
    """Start ``cmd`` in its own process group, so that :func:`kill_group` also reaches torchrun's workers."""
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def kill_group(proc: subprocess.Popen) -> None:
    """Kill what is left of ``proc``'s process group (a hung or failed test must not leave workers behind)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def final_params(run_dir: Path, model_overrides: list[str], step: int | None = None) -> dict[str, torch.Tensor]:
    """Model parameters saved in ``run_dir``'s latest (or ``step``) checkpoint, loaded in this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from distckpt.train import latest_checkpoint
    from launch.build import build_model

    cfg = compose(model_overrides)
    model = build_model(cfg.model, cfg.data)
    sd = {"train": {"model": model.state_dict()}}
    path = run_dir / "checkpoints" / f"step_{step}" if step else latest_checkpoint(run_dir / "checkpoints")
    assert path is not None and path.is_dir(), f"no checkpoint in {run_dir}"
    with warnings.catch_warnings():  # DCP says it assumes one process: it is one
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True))
    return sd["train"]["model"]


def assert_params_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *, exact: bool) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), f"{k} differs: max |diff| {(a[k] - b[k]).abs().max().item():.3g}"
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


class TensorLossNet(torch.nn.Module):
    """Breaks the model protocol on purpose: its forward returns one tensor, not a dict of named losses."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(dim, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.fc(batch["x"]).mean()


def write_tiny_gpt2(path: Path) -> Path:
    """A tiny GPT-2 written with ``save_pretrained`` from a config (no download): a "pretrained" directory.

    No dropout: each rank has its own dropout stream, so 2 ranks would not match one process (GPT-2's
    config defaults to 0.1).
    """
    import transformers

    torch.manual_seed(123)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path


def write_tiny_llama(path: Path, *, vocab_size: int = 256, context: int = 32) -> Path:
    """A tiny Llama of ``vocab_size`` tokens and ``context`` positions, saved with ``save_pretrained`` from a
    config (no download). Llama has no dropout, so 2 ranks can match one process."""
    import transformers

    torch.manual_seed(321)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=context,
        bos_token_id=1,
        eos_token_id=2,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "small",
    "birds",
    "sing",
    "in",
    "tall",
    "green",
    "trees",
]


def write_jsonl(path: Path, n: int, *, field: str = "text", seed: int = 0) -> Path:
    """``n`` documents of a few words each, one JSON object a line: ``{"text": ..., "doc": i}``."""
    import json
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
            f.write(json.dumps({field: f"doc {i % 10} {words}", "doc": i}) + "\n")
    return path


def write_tokenizer(path: Path) -> Path:
    """A word-level tokenizer of :data:`WORDS` (and the digits), with ``<eos>``, saved with ``save_pretrained``
    (built, not downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = [" ".join(WORDS), "doc " + " ".join(map(str, range(10)))]
    raw.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", eos_token="<eos>").save_pretrained(path)
    return path


def assert_saved_adapter(run_dir: Path, pretrained: str | Path, trained: dict[str, torch.Tensor]) -> None:
    """``run_dir/hf/`` of a LoRA run from ``pretrained``: the adapter loads with peft onto the pretrained base and
    is the trained one (``trained``: the run's final parameters), the base stayed the pretrained one, and the
    task head is saved too."""
    import peft
    import transformers

    out = run_dir / "hf"
    assert (out / "adapter_config.json").is_file() and (out / "task_head.pt").is_file()
    base = transformers.AutoModelForCausalLM.from_pretrained(pretrained, local_files_only=True)
    original = {k: v.clone() for k, v in base.state_dict().items()}
    loaded = peft.PeftModel.from_pretrained(base, out).state_dict()
    lora = {k: v for k, v in loaded.items() if "lora_" in k}
    assert lora and all(torch.equal(v, trained[f"lm.{k}"]) for k, v in lora.items())  # the trained adapter
    assert any(k.endswith("lora_B.default.weight") and v.abs().sum() > 0 for k, v in lora.items())  # B starts at 0
    frozen = {k[3:]: v for k, v in trained.items() if k.startswith("lm.") and "lora_" not in k}
    for k, v in frozen.items():  # the base stayed the pretrained one
        k = k.replace("base_model.model.", "").replace(".base_layer", "")
        assert torch.equal(v, original[k]), k
    head = torch.load(out / "task_head.pt")
    assert torch.equal(head["weight"], trained["cls_head.weight"])


def checkpoint_entries(path: Path) -> dict[str, object]:
    """Every entry of the DCP checkpoint at ``path``, flattened to dotted keys (model, optimizer, scheduler,
    step, each rank's data position and RNG state), read in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(path), f"{tmp}/all.pt")
        return _leaves(torch.load(f"{tmp}/all.pt", weights_only=False), "")


def _leaves(value: object, prefix: str) -> dict[str, object]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _leaves(item, f"{prefix}{key}.").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in _leaves(item, f"{prefix}{i}.").items()}
    return {prefix[:-1]: value}


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def assert_checkpoints_equal(a: Path, b: Path) -> None:
    """The two checkpoints hold the same entries with equal values (tensors bitwise), not only equal weights."""
    x, y = checkpoint_entries(a), checkpoint_entries(b)
    assert x.keys() == y.keys(), f"entries differ: {sorted(x.keys() ^ y.keys())[:6]}"
    differ = [k for k in x if not (torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else bool(x[k] == y[k]))]
    assert not differ, f"{len(differ)} of {len(x)} entries differ between {a} and {b}: " + ", ".join(
        f"{k} ({_short(x[k])} vs {_short(y[k])})" if not isinstance(x[k], torch.Tensor) else k for k in differ[:6]
    )
    groups = {k.split(".")[1] for k in x}
    assert {"model", "optim", "scheduler", "step", "data", "rng"} <= groups, groups  # all of it was compared
