"""Tiny Hugging Face models of many families, built from their config classes (random init, no
download), with a sample training batch and a loss: shared by the unit zoo test and the 2-rank tests.

Sizes (chosen so the whole zoo trains on a 2-core CPU in seconds): 4 layers (2 per stack for
encoder-decoders, so both stacks together have 4), hidden 64, 4 heads (2 KV heads where the family
has grouped-query attention), MLP 128, vocab 128, sequence 16, batch 2; MoE families 4 experts,
top-2; Whisper 8 mel bins and 16 input frames; ViT (and CLIP's vision tower, 2 layers beside a
text tower of 2) 32x32 images in 8x8 patches. Dropout is 0.1
wherever the config has it, and every batch of a model that takes an ``attention_mask`` is padded:
the second row ends with 4 masked positions. Decoders use ``labels = input_ids`` with -100 at the
padding.

API (stable; the distributed tests import it)::

    FAMILIES: dict[str, Family]
    fam.build() -> nn.Module         # seeded, in train mode
    fam.batch(seed) -> dict          # keyword arguments of one forward
    fam.blocks -> tuple[str, ...]    # class names blocks=None should pick (one per stack)
    fam.loss(model, batch) -> Tensor # a scalar to call backward on
    lora(model) -> peft model        # LoRA on the attention projections, the rest frozen
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

__all__ = ["FAMILIES", "Family", "lora", "VOCAB", "SEQ", "BATCH", "HIDDEN", "LAYERS"]

VOCAB, SEQ, BATCH, HIDDEN, LAYERS, HEADS, FFN = 128, 16, 2, 64, 4, 4, 128
PAD = 4  # masked positions at the end of the second row
DROP = 0.1


def _ids(seed: int, n: int = SEQ) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB, (BATCH, n), generator=g)


def _mask(n: int = SEQ) -> torch.Tensor:
    mask = torch.ones(BATCH, n, dtype=torch.long)
    mask[1, n - PAD :] = 0
    return mask


def _labels(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ids.masked_fill(mask == 0, -100)


def causal_batch(seed: int) -> dict[str, Any]:
    """A padded causal-LM batch: ``input_ids``, ``attention_mask``, ``labels``."""
    ids, mask = _ids(seed), _mask()
    return {"input_ids": ids, "attention_mask": mask, "labels": _labels(ids, mask)}


def mlm_batch(seed: int) -> dict[str, Any]:
    """A padded masked-LM batch (labels are the tokens, -100 at padding)."""
    ids, mask = _ids(seed), _mask()
    return {"input_ids": ids, "attention_mask": mask, "labels": _labels(ids, mask)}


def seq2seq_batch(seed: int) -> dict[str, Any]:
    """A padded encoder batch and decoder labels (the model shifts them into decoder inputs)."""
    ids, mask = _ids(seed), _mask()
    target = _ids(seed + 1000, SEQ // 2)
    target[1, -2:] = -100  # a shorter second target
    return {"input_ids": ids, "attention_mask": mask, "labels": target}


def whisper_batch(seed: int) -> dict[str, Any]:
    """Log-mel features (8 bins, 16 frames) and decoder labels."""
    g = torch.Generator().manual_seed(seed)
    target = _ids(seed + 1000, SEQ // 2)
    target[1, -2:] = -100
    return {"input_features": torch.randn(BATCH, 8, 16, generator=g), "labels": target}


def image_batch(seed: int) -> dict[str, Any]:
    """32x32 RGB images and class labels (4 classes)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g),
        "labels": torch.randint(0, 4, (BATCH,), generator=g),
    }


def clip_batch(seed: int) -> dict[str, Any]:
    """A padded caption batch, one 32x32 image per caption (the contrastive loss pairs row i with image i):
    the captions end with the highest token (CLIP's text tower pools at ``argmax(input_ids)``: config
    ``eos_token_id=2``, its original convention) before the padding."""
    ids, mask = _ids(seed), _mask()
    ids[0, -1] = ids[1, -PAD - 1] = VOCAB - 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "pixel_values": image_batch(seed)["pixel_values"],
        "return_loss": True,
    }


def default_loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The model's own loss (every zoo batch carries labels, or CLIP's ``return_loss``)."""
    return model(**batch).loss


@dataclass(frozen=True)
class Family:
    """One model family: how to build a tiny model and feed it.

    Attributes:
        name: short name (the key in :data:`FAMILIES`).
        make: builds the model (unseeded; :meth:`build` seeds it).
        make_batch: ``seed -> kwargs`` of one training forward.
        blocks: class names of the layers ``blocks=None`` should pick, one per stack.
        kind: ``"decoder"``, ``"encoder"``, ``"seq2seq"``, ``"vision"``, ``"multimodal"`` or ``"moe"``.
        notes: what is special about the family (shown in docs/models.md).
    """

    name: str
    make: Callable[[], nn.Module]
    make_batch: Callable[[int], dict[str, Any]] = causal_batch
    blocks: tuple[str, ...] = ()
    kind: str = "decoder"
    notes: str = ""
    loss_fn: Callable[[nn.Module, dict[str, Any]], torch.Tensor] = field(default=default_loss, repr=False)

    def build(self, seed: int = 0) -> nn.Module:
        """The model with seeded random weights, in train mode."""
        torch.manual_seed(seed)
        return self.make().train()

    def batch(self, seed: int = 0) -> dict[str, Any]:
        """Keyword arguments of one training forward."""
        return self.make_batch(seed)

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """A scalar loss of ``model`` on ``batch``."""
        return self.loss_fn(model, batch)


def _hf(model_cls: str, config_cls: str, **cfg: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import transformers

        config = getattr(transformers, config_cls)(**cfg)
        return getattr(transformers, model_cls)(config)

    return make


_LLAMA = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=FFN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attention_dropout=DROP,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)
# ViT's and CLIP's image tower: 32x32 images in 8x8 patches.
_IMAGE = dict(
    hidden_size=HIDDEN,
    num_attention_heads=HEADS,
    intermediate_size=FFN,
    image_size=32,
    patch_size=8,
    attention_dropout=DROP,
)


def _clip() -> nn.Module:
    import transformers

    # Two towers of 2 layers each (4 in all, as the encoder-decoders): the text tower registered first,
    # the vision tower run first.
    text = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS // 2,
        num_attention_heads=HEADS,
        max_position_embeddings=64,
        attention_dropout=DROP,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = {**_IMAGE, "num_hidden_layers": LAYERS // 2}
    return transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=32))


def _families() -> dict[str, Family]:
    fams = [
        Family(
            "gpt2",
            _hf(
                "GPT2LMHeadModel",
                "GPT2Config",
                vocab_size=VOCAB,
                n_embd=HIDDEN,
                n_layer=LAYERS,
                n_head=HEADS,
                n_positions=64,
                bos_token_id=0,
                eos_token_id=0,
                resid_pdrop=DROP,
                embd_pdrop=DROP,
                attn_pdrop=DROP,
            ),
            blocks=("GPT2Block",),
            notes="cache passed positionally (layer_past)",
        ),
        Family("llama", _hf("LlamaForCausalLM", "LlamaConfig", **_LLAMA), blocks=("LlamaDecoderLayer",)),
        Family(
            "mistral",
            _hf("MistralForCausalLM", "MistralConfig", **_LLAMA, sliding_window=8),
            blocks=("MistralDecoderLayer",),
            notes="sliding window 8",
        ),
        Family("qwen2", _hf("Qwen2ForCausalLM", "Qwen2Config", **_LLAMA), blocks=("Qwen2DecoderLayer",)),
        Family("qwen3", _hf("Qwen3ForCausalLM", "Qwen3Config", **_LLAMA, head_dim=16), blocks=("Qwen3DecoderLayer",)),
        Family("gemma", _hf("GemmaForCausalLM", "GemmaConfig", **_LLAMA, head_dim=16), blocks=("GemmaDecoderLayer",)),
        Family(
            "gemma2",
            _hf("Gemma2ForCausalLM", "Gemma2Config", **_LLAMA, head_dim=16, sliding_window=8),
            blocks=("Gemma2DecoderLayer",),
            notes="hybrid cache, sliding window 8, soft-capping",
        ),
        Family(
            "phi",
            _hf(
                "PhiForCausalLM",
                "PhiConfig",
                vocab_size=VOCAB,
                hidden_size=HIDDEN,
                intermediate_size=FFN,
                num_hidden_layers=LAYERS,
                num_attention_heads=HEADS,
                max_position_embeddings=64,
                attention_dropout=DROP,
                resid_pdrop=DROP,
                embd_pdrop=DROP,
                pad_token_id=0,
            ),
            blocks=("PhiDecoderLayer",),
            notes="partial rotary, parallel attention/MLP",
        ),
        Family(
            "phi3",
            _hf(
                "Phi3ForCausalLM",
                "Phi3Config",
                vocab_size=VOCAB,
                hidden_size=HIDDEN,
                intermediate_size=FFN,
                num_hidden_layers=LAYERS,
                num_attention_heads=HEADS,
                num_key_value_heads=2,
                max_position_embeddings=64,
                attention_dropout=DROP,
                resid_pdrop=DROP,
                embd_pdrop=DROP,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
            ),
            blocks=("Phi3DecoderLayer",),
            notes="fused qkv and gate_up projections",
        ),
        Family(
            "gpt_neox",
            _hf(
                "GPTNeoXForCausalLM",
                "GPTNeoXConfig",
                vocab_size=VOCAB,
                hidden_size=HIDDEN,
                intermediate_size=FFN,
                num_hidden_layers=LAYERS,
                num_attention_heads=HEADS,
                max_position_embeddings=64,
                attention_dropout=DROP,
                hidden_dropout=DROP,
            ),
            blocks=("GPTNeoXLayer",),
        ),
        Family(
            "opt",
            _hf(
                "OPTForCausalLM",
                "OPTConfig",
                vocab_size=VOCAB,
                hidden_size=HIDDEN,
                ffn_dim=FFN,
                num_hidden_layers=LAYERS,
                num_attention_heads=HEADS,
                max_position_embeddings=64,
                word_embed_proj_dim=HIDDEN,
                dropout=DROP,
                attention_dropout=DROP,
                pad_token_id=1,
            ),
            blocks=("OPTDecoderLayer",),
        ),
        Family(
            "falcon",
            _hf(
                "FalconForCausalLM",
                "FalconConfig",
                vocab_size=VOCAB,
                hidden_size=HIDDEN,
                num_hidden_layers=LAYERS,
                num_attention_heads=HEADS,
                attention_dropout=DROP,
                hidden_dropout=DROP,
                new_decoder_architecture=False,
                multi_query=True,
            ),
            blocks=("FalconDecoderLayer",),
            notes="multi-query attention, parallel attention/MLP",
        ),
        Family(
            "mixtral",
            _hf("MixtralForCausalLM", "MixtralConfig", **_LLAMA, **_MOE),
            blocks=("MixtralDecoderLayer",),
            kind="moe",
            notes="MoE: 4 experts, top-2",
        ),
        Family(
            "qwen2_moe",
            _hf(
                "Qwen2MoeForCausalLM",
                "Qwen2MoeConfig",
                **_LLAMA,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=64,
                shared_expert_intermediate_size=64,
                decoder_sparse_step=1,
            ),
            blocks=("Qwen2MoeDecoderLayer",),
            kind="moe",
            notes="MoE: 4 experts, top-2, shared expert",
        ),
        Family(
            "olmoe",
            _hf("OlmoeForCausalLM", "OlmoeConfig", **_LLAMA, num_experts=4, num_experts_per_tok=2),
            blocks=("OlmoeDecoderLayer",),
            kind="moe",
            notes="MoE: 4 experts, top-2",
        ),
        Family(
            "bert",
            _hf(
                "BertForMaskedLM",
                "BertConfig",
                vocab_size=VOCAB,
                hidden_size=HIDDEN,
                num_hidden_layers=LAYERS,
                num_attention_heads=HEADS,
                intermediate_size=FFN,
                max_position_embeddings=64,
                hidden_dropout_prob=DROP,
                attention_probs_dropout_prob=DROP,
            ),
            make_batch=mlm_batch,
            blocks=("BertLayer",),
            kind="encoder",
        ),
        Family(
            "roberta",
            _hf(
                "RobertaForMaskedLM",
                "RobertaConfig",
                vocab_size=VOCAB,
                hidden_size=HIDDEN,
                num_hidden_layers=LAYERS,
                num_attention_heads=HEADS,
                intermediate_size=FFN,
                max_position_embeddings=64,
                hidden_dropout_prob=DROP,
                attention_probs_dropout_prob=DROP,
            ),
            make_batch=mlm_batch,
            blocks=("RobertaLayer",),
            kind="encoder",
        ),
        Family(
            "distilbert",
            _hf(
                "DistilBertForMaskedLM",
                "DistilBertConfig",
                vocab_size=VOCAB,
                dim=HIDDEN,
                n_layers=LAYERS,
                n_heads=HEADS,
                hidden_dim=FFN,
                max_position_embeddings=64,
                dropout=DROP,
                attention_dropout=DROP,
            ),
            make_batch=mlm_batch,
            blocks=("TransformerBlock",),
            kind="encoder",
        ),
        Family(
            "t5",
            _hf(
                "T5ForConditionalGeneration",
                "T5Config",
                vocab_size=VOCAB,
                d_model=HIDDEN,
                d_kv=16,
                d_ff=FFN,
                num_layers=LAYERS // 2,
                num_decoder_layers=LAYERS // 2,
                num_heads=HEADS,
                dropout_rate=DROP,
                decoder_start_token_id=0,
                pad_token_id=0,
            ),
            make_batch=seq2seq_batch,
            blocks=("T5Block",),
            kind="seq2seq",
            notes="one block class in both stacks; the decoder stack holds its own config copy",
        ),
        Family(
            "bart",
            _hf(
                "BartForConditionalGeneration",
                "BartConfig",
                vocab_size=VOCAB,
                d_model=HIDDEN,
                encoder_layers=LAYERS // 2,
                decoder_layers=LAYERS // 2,
                encoder_attention_heads=HEADS,
                decoder_attention_heads=HEADS,
                encoder_ffn_dim=FFN,
                decoder_ffn_dim=FFN,
                max_position_embeddings=64,
                dropout=DROP,
                attention_dropout=DROP,
                decoder_start_token_id=2,
                pad_token_id=1,
            ),
            make_batch=seq2seq_batch,
            blocks=("BartEncoderLayer", "BartDecoderLayer"),
            kind="seq2seq",
        ),
        Family(
            "whisper",
            _hf(
                "WhisperForConditionalGeneration",
                "WhisperConfig",
                vocab_size=VOCAB,
                d_model=HIDDEN,
                encoder_layers=LAYERS // 2,
                decoder_layers=LAYERS // 2,
                encoder_attention_heads=HEADS,
                decoder_attention_heads=HEADS,
                encoder_ffn_dim=FFN,
                decoder_ffn_dim=FFN,
                num_mel_bins=8,
                max_source_positions=8,
                max_target_positions=32,
                dropout=DROP,
                attention_dropout=DROP,
                decoder_start_token_id=1,
                pad_token_id=0,
                begin_suppress_tokens=None,
                suppress_tokens=None,
            ),
            make_batch=whisper_batch,
            blocks=("WhisperEncoderLayer", "WhisperDecoderLayer"),
            kind="seq2seq",
            notes="mel features in (no attention mask)",
        ),
        Family(
            "vit",
            _hf(
                "ViTForImageClassification",
                "ViTConfig",
                **{k: v for k, v in _IMAGE.items() if k != "attention_dropout"},
                num_hidden_layers=LAYERS,
                num_labels=4,
                hidden_dropout_prob=DROP,
                attention_probs_dropout_prob=DROP,
            ),
            make_batch=image_batch,
            blocks=("ViTLayer",),
            kind="vision",
            notes="no attention mask",
        ),
        Family(
            "clip",
            _clip,
            make_batch=clip_batch,
            blocks=("CLIPEncoderLayer",),
            kind="multimodal",
            notes="two towers (text, vision), contrastive loss; the vision tower runs first, registered second",
        ),
    ]
    out = {f.name: f for f in fams}
    out["llama_lora"] = Family(
        "llama_lora",
        lambda: lora(out["llama"].make()),
        blocks=("LlamaDecoderLayer",),
        notes="peft LoRA r=4 on q/v; everything else frozen",
    )
    return out


def lora(model: nn.Module, r: int = 4, targets: tuple[str, ...] = ("q_proj", "v_proj")) -> nn.Module:
    """``model`` wrapped by peft with LoRA adapters on ``targets`` (dropout 0.1); the base is frozen.

    The adapters' B matrices start at zero (peft's default), which would leave A's gradients zero:
    they are drawn at random here so that every gradient is a real check.
    """
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=DROP, target_modules=list(targets)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


FAMILIES: dict[str, Family] = _families()
