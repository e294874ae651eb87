"""`model=hf model.pretrained=DIR [model.lora.r=N]`: local pretrained weights, LoRA, and RUN_DIR/hf/ loaded back."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from launchkit import ROOT, assert_params_equal, compose, env, final_params, torchrun, write_tiny_gpt2

from launch.run import train

pytestmark = pytest.mark.launch
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    return write_tiny_gpt2(tmp_path_factory.mktemp("pretrained") / "gpt2-tiny")


def _over(pretrained, *extra):
    return ["model=hf", f"model.pretrained={pretrained}", "model.seq_len=16", "data.batch_size=8", "data.n=64",
            "data.n_eval=0", "trainer=debug", "trainer.max_steps=5", "trainer.save_every=0", "trainer.eval_every=0",
            *extra]


def _base(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in sd.items() if "lora_" not in k}


def test_lora_on_2_ranks_matches_a_single_process_and_saves_a_loadable_adapter(pretrained, tmp_path):
    over = _over(pretrained, "model.lora.r=4", "model.lora.alpha=8")
    proc = torchrun([*over, "strategy=ddp"], tmp_path / "ddp")
    assert "hf weights" in proc.stdout
    train(compose([*over, "strategy=none", "ac=none"]), run_dir=tmp_path / "ref")
    trained = final_params(tmp_path / "ddp", over)
    assert_params_equal(trained, final_params(tmp_path / "ref", over), exact=False)
    out = tmp_path / "ddp" / "hf"
    assert (out / "adapter_config.json").is_file() and (out / "task_head.pt").is_file()
    base = transformers.AutoModelForCausalLM.from_pretrained(pretrained, local_files_only=True)
    original = {k: v.clone() for k, v in base.state_dict().items()}
    loaded = peft.PeftModel.from_pretrained(base, out).state_dict()
    lora = {k: v for k, v in loaded.items() if "lora_" in k}
    assert lora and all(torch.equal(v, trained[f"lm.{k}"]) for k, v in lora.items())  # the trained adapter
    assert any(k.endswith("lora_B.default.weight") and v.abs().sum() > 0 for k, v in lora.items())  # B starts at 0
    frozen = {k: v for k, v in trained.items() if k.startswith("lm.") and "lora_" not in k}
    for k, v in _base({k[3:]: v for k, v in frozen.items()}).items():  # the base stayed the pretrained one
        assert torch.equal(v, original[k]), k
    head = torch.load(out / "task_head.pt")
    assert torch.equal(head["weight"], trained["cls_head.weight"])


def test_without_lora_the_whole_model_trains_and_is_saved(pretrained, tmp_path):
    over = _over(pretrained)
    train(compose([*over, "strategy=none"]), run_dir=tmp_path / "full")
    trained = final_params(tmp_path / "full", over)
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "hf", local_files_only=True)
    for k, v in saved.state_dict().items():
        assert torch.equal(v, trained[f"lm.{k}"]), k
    original = transformers.AutoModelForCausalLM.from_pretrained(pretrained, local_files_only=True)
    assert not torch.equal(saved.transformer.h[0].attn.c_attn.weight, original.transformer.h[0].attn.c_attn.weight)


def test_check_refuses_a_missing_pretrained_directory(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), "--check", "model=hf",
                           f"model.pretrained={tmp_path / 'none'}"], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "is not a local directory with a config.json" in proc.stderr, proc.stderr
