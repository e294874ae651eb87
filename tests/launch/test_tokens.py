"""`data=tokens`: nanoGPT-style token files written by scripts/make_tokens.py, trained on 2 ranks."""

from __future__ import annotations

import numpy as np
import pytest
from launchkit import assert_params_equal, check_in_process, compose, final_params, run_script, train_on_ranks

from launch.run import train

pytestmark = pytest.mark.launch

TEXT = "the quick brown fox jumps over the lazy dog; " * 40 + "ünïcödé ok\n"


def _make(args: list[str]) -> str:
    """``python scripts/make_tokens.py ARGS``, run in this process (launchkit.run_script); its stdout."""
    return run_script(["scripts/make_tokens.py", *args])


@pytest.fixture(scope="module")
def byte_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    (root / "in.txt").write_text(TEXT, encoding="utf-8")
    stdout = _make([str(root / "in.txt"), str(root / "out"), "--eval-fraction", "0.2"])
    return root / "out", stdout


def test_byte_level_file_is_the_utf8_bytes(byte_files):
    out, stdout = byte_files
    data = list(TEXT.encode("utf-8"))
    cut = len(data) - int(len(data) * 0.2)
    assert np.fromfile(out / "train.bin", dtype="uint16").tolist() == data[:cut]
    assert np.fromfile(out / "val.bin", dtype="uint16").tolist() == data[cut:]
    assert f"data.path={out / 'train.bin'}" in stdout and "data.dtype=uint16 model.vocab_size=256" in stdout


def test_a_tokenizer_saved_in_a_local_directory(tmp_path):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator([TEXT], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    (tmp_path / "in.txt").write_text(TEXT, encoding="utf-8")
    stdout = _make(
        [str(tmp_path / "in.txt"), str(tmp_path / "out"), "--tokenizer", str(tmp_path / "tok"), "--eval-fraction", "0"]
    )
    want = AutoTokenizer.from_pretrained(tmp_path / "tok", local_files_only=True)(TEXT)["input_ids"]
    assert len(want) > 100 and np.fromfile(tmp_path / "out" / "train.bin", dtype="uint16").tolist() == want
    assert f"model.vocab_size={raw.get_vocab_size()}" in stdout


def test_token_file_on_2_ranks_matches_a_single_process(byte_files, dist_pool, tmp_path):
    """On the pool's 2 ranks as torchrun's workers run it (launchkit.train_on_ranks; torchrun: test_torchrun.py)."""
    out, _ = byte_files
    over = [
        "data=tokens",
        f"data.path={out / 'train.bin'}",
        f"data.eval_path={out / 'val.bin'}",
        "model.vocab_size=256",
        "model.seq_len=16",
        "model.n_layer=2",
        "model.d_model=32",
        "model.n_head=2",
        "data.batch_size=8",
        "trainer=debug",
        "trainer.max_steps=16",
        "trainer.save_every=0",
        "trainer.eval_every=8",
    ]  # 1452 train bytes / 16 = 90 windows: 11 batches per epoch, 16 steps cross one
    dist_pool.run(train_on_ranks, [*over, "strategy=ddp"], str(tmp_path / "ddp"))
    ref = train(compose([*over, "strategy=none", "ac=none"]), run_dir=tmp_path / "ref")
    assert set(ref.losses) == {"loss", "lm"} and ref.eval_loss is not None
    assert_params_equal(final_params(tmp_path / "ddp", over), final_params(tmp_path / "ref", over), exact=False)


def test_check_refuses_a_missing_token_file(tmp_path, monkeypatch, capsys):
    code, err = check_in_process(["--check", "data=tokens", f"data.path={tmp_path / 'nope.bin'}"], monkeypatch, capsys)
    assert code == 2 and "nope.bin is not a file; write one with scripts/make_tokens.py" in err, err
