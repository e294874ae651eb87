"""`data=hf`: local JSONL/text through `datasets`, tokenized with a local tokenizer (built here, nothing
downloaded), packed into model.seq_len windows; the token cache and the stream hold the same windows, the
stream resumes exactly from its readers' states, and the issue's command fine-tunes on 2 ranks like one process."""

from __future__ import annotations

import importlib.util
import json
import shutil

import numpy as np
import pytest
import torch
from launchkit import (
    assert_checkpoints_equal,
    assert_params_equal,
    check_in_process,
    compose,
    final_params,
    train_on_ranks,
    write_jsonl,
    write_tiny_llama,
    write_tokenizer,
)

from distckpt.train.data import ShardedLoader
from launch.build import build_datasets
from launch.run import train

pytestmark = [
    pytest.mark.launch,
    *(
        pytest.mark.skipif(importlib.util.find_spec(name) is None, reason=f"needs {name}")
        for name in ("datasets", "transformers", "peft")
    ),
]

SEQ = 16


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny Llama with a word-level tokenizer saved beside it, a JSONL file of 300 documents, the same split
    over 4 files, and a token cache folder."""
    root = tmp_path_factory.mktemp("hfdata")
    model = write_tokenizer(write_tiny_llama(root / "llama"))
    write_jsonl(root / "docs.jsonl", 300)
    (root / "parts").mkdir()
    lines = (root / "docs.jsonl").read_text().splitlines(keepends=True)
    for k in range(4):
        (root / "parts" / f"part{k}.jsonl").write_text("".join(lines[k::4]))
    return root, model


def _over(root, model, *extra):
    return [
        "model=hf",
        f"model.pretrained={model}",
        f"model.seq_len={SEQ}",
        "data=hf",
        f"data.path={root / 'docs.jsonl'}",
        f"data.cache_dir={root / 'cache'}",
        "data.batch_size=8",
        "trainer=debug",
        "trainer.eval_every=0",
        *extra,
    ]


def _expected_ids(root, model) -> list[int]:
    """The documents' ids as the tokenizer gives them, each followed by eos: the packed stream."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    texts = [json.loads(line)["text"] for line in (root / "docs.jsonl").read_text().splitlines()]
    return [i for t in texts for i in [*tok(t)["input_ids"], tok.eos_token_id]]


def test_the_token_cache_is_the_tokenized_documents_in_windows(files):
    root, model = files
    cfg = compose(_over(root, model))
    train_set, eval_set = build_datasets(cfg.data, cfg.model)
    ids = _expected_ids(root, model)
    assert eval_set is None and len(train_set) == len(ids) // SEQ
    assert [train_set[k]["tokens"].tolist() for k in (0, 5)] == [ids[:SEQ], ids[5 * SEQ : 6 * SEQ]]
    assert len(set(ids)) > 20 and max(ids) < 256  # the words, digits and eos, below the vocabulary
    again, _ = build_datasets(cfg.data, cfg.model)  # a second start reads the cache, does not rewrite it
    assert again.path == train_set.path and len(list((root / "cache" / "tokens").iterdir())) == 1


def test_the_stream_packs_the_same_windows_and_shuffles_them_in_blocks(files):
    root, model = files
    ids = _expected_ids(root, model)
    windows = [ids[k * SEQ : (k + 1) * SEQ] for k in range(len(ids) // SEQ)]
    in_order, _ = build_datasets(*_cfg(root, model, "data.streaming=true", "data.shuffle=false"))
    assert [w["tokens"].tolist() for w in in_order] == windows
    shuffled, _ = build_datasets(*_cfg(root, model, "data.streaming=true", "data.shuffle_block=8"))
    got = [w["tokens"].tolist() for w in shuffled]
    assert got != windows and sorted(got) == sorted(windows)
    assert sorted(got[:8]) == sorted(windows[:8])  # a block of 8 windows, permuted within itself


def _cfg(root, model, *extra):
    cfg = compose(_over(root, model, *extra))
    return cfg.data, cfg.model


def test_the_stream_is_read_in_part_from_several_files_and_resumes_from_its_state(files):
    root, model = files
    d, m = _cfg(root, model, "data.streaming=true", "data.shuffle_block=4", f"data.path={root / 'parts' / '*.jsonl'}")
    stream, _ = build_datasets(d, m)
    shards = stream.docs.num_shards  # byte ranges of the 4 files: a multiple of the 4 readers, each its own
    assert shards % 4 == 0 and stream.shard(1, 2, 0, 2).part.num_shards == shards // 4

    def take(ld, n):
        return [ld.next_batch()["tokens"].tolist() for _ in range(n)]

    ref = take(ShardedLoader(stream, 4, rank=1, world_size=2, num_workers=2), 9)
    first = ShardedLoader(stream, 4, rank=1, world_size=2, num_workers=2)
    assert take(first, 5) == ref[:5]  # mid-block: 5 batches of 2 windows, blocks of 4
    resumed = ShardedLoader(stream, 4, rank=1, world_size=2, num_workers=2)
    resumed.load_state_dict(first.state_dict())
    assert take(resumed, 4) == ref[5:]


def test_a_streamed_run_resumed_mid_run_saves_the_uninterrupted_state(files, tmp_path):
    root, model = files
    over = _over(root, model, "data.streaming=true", "data.num_workers=2", "strategy=none", "trainer.max_steps=6")
    train(compose([*over, "trainer.save_every=3"]), run_dir=tmp_path / "full")
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_6")
    res = train(compose([*over, "trainer.save_every=3"]), run_dir=tmp_path / "cut")
    assert res.start_step == 3
    assert_checkpoints_equal(tmp_path / "cut" / "checkpoints" / "step_6", tmp_path / "full" / "checkpoints" / "step_6")


def test_the_issue_command_fine_tunes_with_lora_on_2_ranks_like_one_process(files, dist_pool, tmp_path):
    root, model = files
    # torchrun launch/train.py model=hf model.pretrained=DIR model.lora.r=8 data=hf data.path=FILE.jsonl, on the
    # pool's 2 ranks as torchrun's workers run it (launchkit.train_on_ranks; torchrun itself: test_torchrun.py)
    over = _over(root, model, "model.lora.r=8", "trainer.max_steps=4", "trainer.save_every=0")
    out = dist_pool.run(train_on_ranks, [*over, "strategy=ddp"], str(tmp_path / "ddp"))
    assert "data=hf strategy=ddp x2" in out[0] and (tmp_path / "ddp" / "hf" / "adapter_config.json").is_file()
    train(compose([*over, "strategy=none", "ac=none"]), run_dir=tmp_path / "one")
    assert_params_equal(final_params(tmp_path / "ddp", over), final_params(tmp_path / "one", over), exact=False)
    lora = {k: v for k, v in final_params(tmp_path / "ddp", over).items() if "lora_B" in k}
    assert lora and all(torch.count_nonzero(v) > 0 for v in lora.values())  # the adapters trained


@pytest.mark.parametrize(
    "override,expect",
    [
        ("data.path=/nonexistent/*.jsonl", "data.path=/nonexistent/*.jsonl matches no file or directory"),
        ("data.text_field=body", "has the columns ['doc', 'text'], no 'body'; set data.text_field=..."),
        ("model.pretrained=null model.config_name=gpt2", "data=hf needs a tokenizer: data.tokenizer=DIR"),
    ],
)
def test_bad_data_hf_settings_are_one_line(files, override, expect, monkeypatch, capsys, tmp_path):
    root, model = files
    over = [*_over(root, model), *override.split()]
    if "text_field" in override:  # found when the documents are read: at start, before training
        with pytest.raises(Exception, match=expect.replace("[", r"\[").replace("]", r"\]")):
            train(compose([*over, "strategy=none", f"data.cache_dir={tmp_path}"]), run_dir=tmp_path / "run")
        return
    code, err = check_in_process(["--check", *over], monkeypatch, capsys)
    assert code == 2 and expect in err and len(err.strip().splitlines()) == 1, err


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(files, tmp_path):
    root, model = files
    over = [*_over(root, model, "strategy=none"), "model.pretrained=null", f"data.tokenizer={model}"]
    with pytest.raises(Exception, match=r"has \d+ tokens, more than model.vocab_size=8; set model.vocab_size="):
        train(compose([*over, "model.vocab_size=8"]), run_dir=tmp_path / "run")


def test_token_ids_fit_the_cache_dtype(files):
    root, model = files
    cfg = compose(_over(root, model))
    train_set, _ = build_datasets(cfg.data, cfg.model)
    assert train_set.dtype == "uint16" and np.fromfile(train_set.path, dtype="uint16").size == train_set.n_tokens


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_byte_ranges_hold_every_document_once_as_the_datasets_builder_reads_them(suffix, tmp_path, monkeypatch):
    """A stream of .jsonl/.txt files is read in byte ranges (resumed by re-reading at most one): cut every few
    bytes, mid-line, across two files, blank lines and a last line without a newline, the ranges hold the rows
    datasets' own json / text builder reads, in order, each once."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    import launch.hf_data as hd

    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta é", "x"]
    docs = [" ".join(rng.choice(words, size=int(rng.integers(1, 6)))) for _ in range(40)]
    if suffix == ".jsonl":
        lines = [json.dumps({"text": t, "n": k}) for k, t in enumerate(docs)]
        lines.insert(7, "")  # blank: datasets' json reader skips it
    else:
        lines = docs[:]
        lines.insert(7, "")  # blank: the text builder keeps it as an empty document
    a, b = tmp_path / f"a{suffix}", tmp_path / f"b{suffix}"
    a.write_text("\n".join(lines[:20]) + "\n")
    b.write_text("\n".join(lines[20:]))  # no newline at the end
    files = [str(a), str(b)]
    builder = hd.BUILDERS[suffix]
    want = [r["text"] for r in datasets.load_dataset(builder, data_files=files, split="train", streaming=True)]
    assert len(want) == 40 + (suffix == ".txt")
    monkeypatch.setattr(hd, "_RANGE_BYTES", 5)  # most ranges start mid-line
    stream = hd.load_text(str(tmp_path / f"*{suffix}"), streaming=True, field="text", readers=4)
    assert stream.num_shards % 4 == 0 and stream.num_shards >= (a.stat().st_size + b.stat().st_size) // 5
    assert [r["text"] for r in stream] == want
    parts = [split_dataset_by_node(stream, rank=k, world_size=4) for k in range(4)]
    got = [r["text"] for p in parts for r in p]
    assert sorted(got) == sorted(want) and all(p.num_shards == stream.num_shards // 4 for p in parts)
