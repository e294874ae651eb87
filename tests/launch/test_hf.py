"""`model=hf model.pretrained=DIR [model.lora.r=N]`: local pretrained weights, LoRA, and RUN_DIR/hf/ loaded back."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
import torch
from launchkit import check_in_process, compose, final_params, write_tiny_gpt2, write_tiny_llama

from distckpt.errors import ConfigError
from launch.config import validate
from launch.run import train

# Skipped without transformers/peft, imported only by the tests that use them: importing peft at collection
# cost every pytest-xdist worker ~6 s of CPU (it imports transformers' models), for the tests of one.
pytestmark = [
    pytest.mark.launch,
    *(
        pytest.mark.skipif(importlib.util.find_spec(name) is None, reason=f"needs {name}")
        for name in ("transformers", "peft")
    ),
]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    return write_tiny_gpt2(tmp_path_factory.mktemp("pretrained") / "gpt2-tiny")


def _over(pretrained, *extra):
    return [
        "model=hf",
        f"model.pretrained={pretrained}",
        "model.seq_len=16",
        "data.batch_size=8",
        "data.n=64",
        "data.n_eval=0",
        "trainer=debug",
        "trainer.max_steps=5",
        "trainer.save_every=0",
        "trainer.eval_every=0",
        *extra,
    ]


# LoRA on 2 ranks against a single process, and its adapter loaded back with peft: in test_multitask.py, on the
# runs of examples/tiny_pretrained.py's command under DDP and FSDP2 (this file's own torchrun of the same
# pretrained GPT-2 + LoRA on one task repeated that run's launch, imports and checks).


def test_without_lora_the_whole_model_trains_and_is_saved(pretrained, tmp_path):
    over = _over(pretrained)
    train(compose([*over, "strategy=none"]), run_dir=tmp_path / "full")
    trained = final_params(tmp_path / "full", over)
    import transformers

    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "hf", local_files_only=True)
    for k, v in saved.state_dict().items():
        assert torch.equal(v, trained[f"lm.{k}"]), k
    original = transformers.AutoModelForCausalLM.from_pretrained(pretrained, local_files_only=True)
    assert not torch.equal(saved.transformer.h[0].attn.c_attn.weight, original.transformer.h[0].attn.c_attn.weight)


def test_check_refuses_a_missing_pretrained_directory(tmp_path, monkeypatch, capsys):
    code, err = check_in_process(["--check", "model=hf", f"model.pretrained={tmp_path / 'none'}"], monkeypatch, capsys)
    assert code == 2 and "is not a local directory with a config.json" in err, err


# --- a pretrained model's own vocabulary and context (issue 24) ---------------------------------------------
@pytest.fixture(scope="module")
def llama256(tmp_path_factory):
    """A saved tiny Llama of vocabulary 256 and 32 positions, and token files of ids below and above it."""
    root = tmp_path_factory.mktemp("llama256")
    ids = np.random.default_rng(0).integers(0, 256, size=2048).astype("uint16")
    ids[100] = 255  # the largest id the vocabulary holds
    ids.tofile(root / "fits.bin")
    ids[200] = 300
    ids.tofile(root / "exceeds.bin")
    return write_tiny_llama(root / "llama"), root


def test_pretrained_vocabulary_and_context_are_the_model_own(llama256, tmp_path):
    model, root = llama256
    over = ["model=hf", f"model.pretrained={model}", "data=tokens", f"data.path={root / 'fits.bin'}"]
    cfg = compose(over)
    assert (cfg.model.vocab_size, cfg.model.seq_len) == (256, 32)  # not the config's defaults 64 and 32
    assert compose([*over, "model.seq_len=16"]).model.seq_len == 16  # an explicit value wins
    res = train(
        compose([*over, "strategy=none", "trainer=debug", "trainer.max_steps=2", "data.batch_size=4"]), tmp_path
    )
    assert res.step == 2 and np.isfinite(res.losses["lm"])


def test_a_token_file_beyond_the_pretrained_vocabulary_is_refused_in_one_line(llama256, tmp_path):
    model, root = llama256
    over = ["model=hf", f"model.pretrained={model}", "data=tokens", f"data.path={root / 'exceeds.bin'}"]
    with pytest.raises(ConfigError) as e:
        train(compose([*over, "strategy=none", "trainer=debug", "trainer.max_steps=2"]), tmp_path)
    assert str(e.value) == (
        f"token file {root / 'exceeds.bin'} has token id 300 >= 256, the vocabulary of model.pretrained={model}; "
        "write the file with that model's tokenizer (scripts/make_tokens.py --tokenizer DIR)."
    )


@pytest.mark.parametrize(
    "override,expect",
    [
        ("model.vocab_size=300", "model.vocab_size=300 exceeds the vocabulary (256) of model.pretrained="),
        ("model.seq_len=64", "model.seq_len=64 is longer than the 32 positions of model.pretrained="),
    ],
)
def test_check_refuses_sizes_beyond_the_pretrained_model(llama256, override, expect, monkeypatch, capsys):
    model, _ = llama256
    code, err = check_in_process(["--check", "model=hf", f"model.pretrained={model}", override], monkeypatch, capsys)
    assert code == 2 and expect in err and len(err.strip().splitlines()) == 1, err


# --- model=hf sizes beyond d_model/n_head: the MLP width and grouped-query attention (issue 14) ---------------
def test_llama_and_gpt2_take_the_mlp_width_and_kv_heads_from_the_config():
    from launch.build import build_model

    cfg = compose(
        [
            "model=hf",
            "model.config_name=llama",
            "model.d_model=64",
            "model.n_head=8",
            "model.kv_heads=2",
            "model.intermediate_size=96",
        ]
    )
    validate(cfg, world_size=1)
    lm = build_model(cfg.model, cfg.data).lm
    assert (lm.config.num_key_value_heads, lm.config.intermediate_size) == (2, 96)
    layer = lm.model.layers[0]
    assert layer.self_attn.k_proj.out_features == 2 * 64 // 8  # two key/value heads of head size 8
    assert layer.self_attn.q_proj.out_features == 64 and layer.mlp.gate_proj.out_features == 96
    gpt2 = compose(["model=hf", "model.config_name=gpt2", "model.intermediate_size=80"])
    assert build_model(gpt2.model, gpt2.data).lm.transformer.h[0].mlp.c_fc.nf == 80  # GPT-2's n_inner
    default = compose(["model=hf", "model.config_name=llama", "model.d_model=32"])  # null: 4 x d_model, n_head
    assert (build_model(default.model, default.data).lm.config.intermediate_size, default.model.kv_heads) == (128, None)
    assert build_model(default.model, default.data).lm.config.num_key_value_heads == default.model.n_head


@pytest.mark.parametrize(
    "override,expect",
    [
        ("model.config_name=llama model.kv_heads=3", "model.n_head=4 must be divisible by model.kv_heads=3"),
        ("model.config_name=llama model.kv_heads=0", "model.kv_heads=0 is out of range: it must be an integer >= 1"),
        ("model.config_name=llama model.intermediate_size=0", "model.intermediate_size=0 is out of range"),
        (
            "model.config_name=gpt2 model.kv_heads=2",
            "model=hf: transformers' gpt2 config has no grouped-query attention",
        ),
    ],
)
def test_check_refuses_bad_mlp_width_and_kv_heads(override, expect, capsys, monkeypatch):
    from launch.check import check_overrides

    argv = ["--check", "model=hf", *override.split()]
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    with pytest.raises(SystemExit) as e:
        check_overrides(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and expect in err[0], err


def test_launcher_plan_of_a_gqa_llama_counts_its_real_parameters(capsys):
    """`distckpt plan model=hf ...` (the README's 70B example, tiny): the sizes reach the planned model."""
    from launch.build import build_model
    from launch.plan import main as launch_plan

    over = [
        "model=hf",
        "model.config_name=llama",
        "model.n_layer=4",
        "model.d_model=64",
        "model.n_head=8",
        "model.kv_heads=2",
        "model.intermediate_size=96",
        "data.batch_size=2",
        "data.n=8",
    ]
    cfg = compose(over)
    real = sum(p.numel() for p in build_model(cfg.model, cfg.data).parameters())
    assert launch_plan([*over, "--strategy", "fsdp2", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert f"{real / 1e6:.2f}M parameters, 4 blocks (lm.model.layers.0, ...; 3 traced), fsdp2, 4 ranks" in out, out
