"""Hugging Face ``Trainer.train`` on the ranks of the test pool (tests/harness.py), and the single-process reference
it is compared with, for tests/integrations/test_hf_trainer.py.

The pool's ranks hold a gloo group and torchrun's variables, so Trainer (through Accelerate) runs in them as under
torchrun. Two kinds of run:

- the seed's case (issue 23): GPT-2 or Llama built from a tiny config (no download), LoRA through peft, and a
  ``compute_loss`` with two forwards, the second task's forward on rank 1 on odd micro-steps only;
- the multi-task patterns of tests/patterns.py, each pattern's loss as the ``compute_loss`` (one backward per
  micro-batch; ``gradient_accumulation_steps`` for the accumulating ones).

Every item of the datasets below is rebuilt from its index, and ``compute_loss`` records which items each rank got
on which micro-step: the reference replays exactly that, without checkpointing, in one process.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from accelerate_fit import kept_environ
from patterns import PATTERNS, batch, build, make_optimizer, shard
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

import distckpt

STEPS = 3  # optimizer steps
BATCH = 2  # items per rank per micro-batch (the seed's case)
SEQ, VOCAB = 8, 64
LR = 0.1

# --- the seed's case: models ------------------------------------------------------------------------------------


def tiny_model(kind: str, lora: bool = True) -> nn.Module:
    """A GPT-2 or Llama causal LM from a tiny config (seeded: the same weights on every rank and in the reference);
    with ``lora``, peft's LoRA on the attention projections (B initialized randomly, so every adapter gets a
    gradient from the first step), everything else frozen."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0,
        )  # fmt: skip
        model, targets = GPT2LMHeadModel(cfg), ["c_attn"]  # a Conv1D: fan_in_fan_out below
    elif kind == "llama":
        cfg = LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=SEQ,
        )  # fmt: skip
        model, targets = LlamaForCausalLM(cfg), ["q_proj", "v_proj"]
    else:
        raise ValueError(kind)
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    lora_cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=targets,
        init_lora_weights=False,
        fan_in_fan_out=kind == "gpt2",
    )
    return get_peft_model(model, lora_cfg)


def tokens(idx: int, which: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * idx + which)
    return torch.randint(0, VOCAB, (SEQ,), generator=g)


class SeedData(torch.utils.data.Dataset):
    """Item ``i``: two token sequences (task a, task b), rebuilt from ``i`` by the reference."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"idx": i, "a": tokens(i, 0), "b": tokens(i, 1)}


def seed_loss(model: nn.Module, inputs: dict[str, Any], step: int, rank: int, both: bool = False) -> torch.Tensor:
    """Task a on every micro-step; task b, a second forward before the one backward, on rank 1 at odd steps (with
    ``both``: on every rank and step, the shape reentrant blocks under DDP's static graph need)."""
    a = inputs["a"]
    loss = model(input_ids=a, labels=a).loss
    if both or (rank == 1 and step % 2 == 1):
        b = inputs["b"]
        loss = loss + model(input_ids=b, labels=b).loss
    return loss


# --- the patterns of tests/patterns.py ----------------------------------------------------------------------------


class PatternData(torch.utils.data.Dataset):
    """Item ``k``: the shard of micro-batch ``m`` of step ``s`` for rank ``r``, ``k = (s * micro + m) * world + r``,
    so that Trainer's sequential sampler, sharded by Accelerate round-robin (one item per batch), hands rank ``r``
    exactly its shards in order."""

    def __init__(self, name: str, world: int, steps: int = STEPS):
        self.pattern, self.world = PATTERNS[name], world
        self.n = steps * self.pattern.micro_batches * world

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k: int) -> dict[str, Any]:
        micro_step, r = divmod(k, self.world)
        s, m = divmod(micro_step, self.pattern.micro_batches)
        x = shard(batch(s, m, seed=self.pattern.data_seed), r, self.world)
        return {"idx": k, "x": x}


def _one_item(features: list[dict[str, Any]]) -> dict[str, Any]:
    (f,) = features
    return {"idx": torch.tensor([f["idx"]]), "x": f["x"]}


# --- the Trainer -------------------------------------------------------------------------------------------------


class LossTrainer(Trainer):
    """Trainer whose ``compute_loss`` is ``loss(model, inputs, micro_step, rank)`` and records, per micro-step,
    the item indices it got (for the reference)."""

    def __init__(
        self,
        *args: Any,
        loss: Callable[..., torch.Tensor],
        make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.loss_fn = loss
        self.make_optimizer = make_optimizer  # the optimizer over the model train() trains (model_init's)
        self.loss_is_scaled_for_ga = False  # a per-batch mean: Trainer divides by gradient_accumulation_steps
        self.seen: list[list[int]] = []  # per micro-step: the item indices this rank got
        self.predicted: list[float] = []  # trainer.predict's losses in the middle of train() (fit's life)
        self.on_first_forward: Callable[[nn.Module], None] | None = None  # gets the model Trainer prepared
        self.after_backward: Callable[[nn.Module], None] | None = None  # after each micro-batch's backward

    def create_optimizer(self, model=None):  # noqa: ANN001
        if self.make_optimizer is None:
            return super().create_optimizer(model)
        if self.optimizer is None:  # Trainer's AdamW would not decay biases: the reference's optimizer instead
            self.optimizer = self.make_optimizer([p for p in self.model.parameters() if p.requires_grad])
        return self.optimizer

    def training_step(self, model, inputs, num_items_in_batch=None):  # noqa: ANN001
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.after_backward is not None:
            self.after_backward(self.model)
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):  # noqa: ANN001
        # The loss only, through compute_loss (the model takes no labels: Trainer's own step would call it bare).
        with torch.no_grad():
            loss = self.compute_loss(model, self._prepare_inputs(inputs))
        return loss.detach(), None, None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001
        if self.on_first_forward is not None:
            self.on_first_forward(model)
            self.on_first_forward = None
        inputs = dict(inputs)
        step = len(self.seen)
        idx = inputs.pop("idx").tolist()
        if model.training:  # evaluate/predict: not a training micro-step
            self.seen.append(idx)
        loss = self.loss_fn(model, inputs, step, self.args.process_index)
        return (loss, None) if return_outputs else loss


class Record(TrainerCallback):
    """Each optimizer step's gradients of the trainable parameters (None kept), by name as in the reference; with
    :func:`count_reductions`, the gradient all-reduces each micro-batch ran."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor | None]] = []
        self.reductions: list[int] = []  # per micro-batch
        self.count = 0

    def on_substep_end(self, args, state, control, **kwargs):  # noqa: ANN001
        self.reductions.append(self.count)
        self.count = 0

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):  # noqa: ANN001
        self.reductions.append(self.count)
        self.count = 0
        self.grads.append(
            {
                _name(n): None if p.grad is None else p.grad.detach().clone()
                for n, p in model.named_parameters()
                if p.requires_grad
            }
        )


def count_reductions(ddp: nn.Module, rec: Record) -> None:
    """Count DDP's gradient all-reduces through its public comm-hook API (the default hook's arithmetic)."""
    world = dist.get_world_size()

    def hook(state, bucket):  # noqa: ANN001
        rec.count += 1
        fut = dist.all_reduce(bucket.buffer().div_(world), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, hook)


def _name(fqn: str) -> str:
    from distckpt.runtime.swap import _clean_fqn

    return _clean_fqn(fqn)


# What every Trainer config of these tests (TrainingArguments, TRL's DPO/SFT/GRPO configs) sets: CPU, plain SGD at a
# constant rate, no clipping, nothing saved or reported, a log line per step, one seed.
PLAIN_SGD: dict[str, Any] = dict(
    use_cpu=True,
    optim="sgd",
    lr_scheduler_type="constant",
    weight_decay=0.0,
    max_grad_norm=0.0,
    dataloader_num_workers=0,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    logging_steps=1,
    seed=0,
)


def training_args(out: str, *, accumulate: int = 1, batch_size: int = BATCH, **kw: Any) -> TrainingArguments:
    """CPU, SGD at a constant rate, no clipping, no shuffling, nothing saved or reported (``kw`` overrides)."""
    defaults = dict(
        PLAIN_SGD,
        output_dir=out,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulate,
        max_steps=STEPS,
        learning_rate=LR,
        train_sampling_strategy="sequential",
        remove_unused_columns=False,
    )
    return TrainingArguments(**{**defaults, **kw})


def _release_accelerate() -> None:
    """Accelerate keeps its process state in class-level singletons: forget them, so the next Trainer in this
    rank reads its arguments afresh (the process group itself stays)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    PartialState._reset_state()


# --- runs --------------------------------------------------------------------------------------------------------

# How the blocks are checkpointed (docs/integrations.md's HF Trainer table): without distckpt's integration, "none":
# not at all; "hf": TrainingArguments(activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant":
# ...}); "wrap": distckpt.wrap on the model before Trainer (passive: Trainer builds DDP with its own flags). With it,
# "distckpt": DistckptCallback + distckpt.integrations.hf.prepare(trainer).
OWN = ("none", "hf", "wrap")
# transformers 5.25 renamed TrainingArguments' gradient_checkpointing* to activation_checkpointing* (the old names warn,
# and go in v6); 4.x has the old ones only.
HF_CKPT = (
    "activation_checkpointing"
    if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    else "gradient_checkpointing"
)


def fit(
    rank: int,
    model: nn.Module,
    dataset: torch.utils.data.Dataset,
    loss: Callable[..., torch.Tensor],
    how: str,
    *,
    reentrant: bool = False,
    accumulate: int = 1,
    batch_size: int = BATCH,
    collate: Callable | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    callback: Any = None,
    count: bool = False,
    perturb: tuple[int, str, float] | None = None,
    catch: bool = True,
    model_init: Callable[[], nn.Module] | None = None,
    trial: dict[str, Any] | None = None,
    life: dict[str, Any] | None = None,
    **targs: Any,
) -> dict[str, Any]:
    """``Trainer.train`` of ``model`` on ``dataset`` with ``loss`` as compute_loss, checkpointed the ``how`` way
    (OWN, or "distckpt": ``callback``, a DistckptCallback, and prepare). {"grads", "params", "seen", "reductions",
    "log_history", "checkpointed", and the prepared model's "wrapper", "find_unused", "static_graph",
    "distributed_type"} on this rank, or {"error": (type, first line), "message"} (raised instead with
    ``catch=False``). ``count``: count DDP's all-reduces per micro-batch; ``perturb=(rank, name, delta)``: add
    ``delta`` to that gradient on that rank after each backward (a desync on purpose). ``model_init``:
    ``Trainer(model_init=model_init)`` instead of ``model`` (``optimizer``, then, is a function of the trainable
    parameters); "checkpointed" is what ``distckpt.checkpointed`` says of the model ``train()`` trained. ``trial``:
    ``train(trial=trial)`` as ``hyperparameter_search`` calls it for one trial (a backend whose trial is a dict of
    argument values; Trainer then builds a new accelerator after model_init's model). ``life``: the rest of
    Trainer's life cycle, see :func:`_run`."""
    if how == "wrap":
        distckpt.wrap(model, "full", reentrant=reentrant)
    if how == "distckpt" and callback is None:
        from distckpt.integrations.hf import DistckptCallback

        callback = DistckptCallback(guard_every=1, reentrant=reentrant)
    if how == "hf":
        targs.update({HF_CKPT: True, f"{HF_CKPT}_kwargs": {"use_reentrant": reentrant}})
    rec = Record()
    flags: dict[str, Any] = {}
    life = life or {}
    with tempfile.TemporaryDirectory() as tmp, kept_environ():
        out = life.get("output_dir", tmp)
        try:
            init = {"model": model, "optimizers": (optimizer, None)}
            if model_init is not None:
                init = {"model_init": model_init, "make_optimizer": optimizer}
            trainer = LossTrainer(
                args=training_args(out, accumulate=accumulate, batch_size=batch_size, **targs),
                train_dataset=dataset,
                eval_dataset=life.get("eval_data"),
                data_collator=collate,
                callbacks=[rec] + ([callback] if callback is not None else []),
                loss=loss,
                **init,
            )
            if how == "distckpt":
                from distckpt.integrations.hf import prepare

                prepare(trainer)
            _instrument(trainer, rank, rec, flags, count, perturb)
            _run(trainer, trial, out, life)
        except Exception as e:  # noqa: BLE001 - what Trainer raises is the measurement
            if not catch:  # the pool's rank closes its group: a peer stuck in a collective raises instead of hanging
                raise
            return {
                "error": (type(e).__name__, str(e).strip().splitlines()[0] if str(e).strip() else ""),
                "message": str(e),
            }
        finally:
            _release_accelerate()
    model = trainer.model  # model_init's: the one train() built
    return {
        "checkpointed": distckpt.checkpointed(model),
        "grads": rec.grads,
        "params": {_name(n): p.detach().clone() for n, p in model.named_parameters()},
        "seen": trainer.seen,
        "reductions": rec.reductions,
        "log_history": trainer.state.log_history,
        "predicted": trainer.predicted,
        **flags,
    }


def _instrument(
    trainer: LossTrainer, rank: int, rec: Record, flags: dict, count: bool, perturb: tuple[int, str, float] | None
) -> None:
    """Record the prepared model's DDP flags (and count its all-reduces) at the first forward; ``perturb``: see
    :func:`fit`."""

    def first(m: nn.Module) -> None:
        flags.update(
            wrapper=type(m).__name__,
            find_unused=getattr(m, "find_unused_parameters", None),
            static_graph=getattr(m, "static_graph", None),
            distributed_type=str(trainer.accelerator.distributed_type),
        )
        if count:
            count_reductions(m, rec)

    trainer.on_first_forward = first
    if perturb is not None and perturb[0] == rank:
        trainer.after_backward = lambda m: dict(m.named_parameters())[perturb[1]].grad.add_(perturb[2])


class _PredictAt(TrainerCallback):
    """``trainer.predict(data)`` after optimizer step ``step``, in the middle of ``train()`` (every rank calls it:
    its forwards and the gathering of its outputs are collective)."""

    def __init__(self, trainer: LossTrainer, data: Any, step: int):
        self.trainer, self.data, self.step = trainer, data, step

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
        if state.global_step == self.step:
            self.trainer.predicted.append(self.trainer.predict(self.data).metrics["test_loss"])


def _run(trainer: LossTrainer, trial: dict[str, Any] | None, out: str, life: dict[str, Any]) -> None:
    """``trainer.train()``, with the life cycle of ``life``: "output_dir" (shared by the ranks: Trainer saves its
    checkpoints there; with ``save_strategy``/``save_steps`` in the arguments), "resume" (a checkpoint folder under it
    for ``resume_from_checkpoint``), "eval_data" (the ``eval_dataset``, for ``eval_strategy``), "predict_at" (an
    optimizer step after which ``trainer.predict(eval_data)`` runs; its loss in "predicted")."""
    if "predict_at" in life:
        trainer.add_callback(_PredictAt(trainer, life["eval_data"], life["predict_at"]))
    if trial is not None:
        from transformers.trainer_utils import HPSearchBackend

        trainer.hp_search_backend = HPSearchBackend.WANDB  # what hyperparameter_search sets; its trials: dicts
        trainer._get_output_dir = lambda trial: out  # not wandb's run directory: no wandb run here
    resume = life.get("resume")
    trainer.train(trial=trial, resume_from_checkpoint=None if resume is None else f"{out}/{resume}")


def seed_fit(
    rank: int,
    world: int,
    kind: str,
    how: str,
    *,
    lora: bool = True,
    accumulate: int = 1,
    both: bool = False,
    **kwargs: Any,
) -> dict[str, Any]:
    """The seed's case under Trainer (see :func:`fit`; ``both``: see :func:`seed_loss`)."""
    data = SeedData(STEPS * accumulate * world * BATCH)
    loss = functools.partial(seed_loss, both=both)
    return fit(rank, tiny_model(kind, lora), data, loss, how, accumulate=accumulate, **kwargs)


def seed_reference(
    kind: str, seen: list[list[list[int]]], *, lora: bool = True, accumulate: int = 1, both: bool = False
) -> tuple:
    """Single process, no checkpointing: what the ranks' micro-steps ``seen[rank][micro_step]`` compute together
    (DDP averages over ranks, Trainer divides by the accumulation steps): (per-step grads, final params)."""
    model = tiny_model(kind, lora)
    model.train()
    world = len(seen)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    data = SeedData(10**6)
    grads = []
    for s in range(len(seen[0]) // accumulate):
        opt.zero_grad(set_to_none=True)
        for r in range(world):
            for m in range(s * accumulate, (s + 1) * accumulate):
                items = [data[i] for i in seen[r][m]]
                inputs = {k: torch.stack([it[k] for it in items]) for k in ("a", "b")}
                (seed_loss(model, inputs, m, r, both) / (world * accumulate)).backward()
        grads.append(
            {
                _name(n): None if p.grad is None else p.grad.clone()
                for n, p in model.named_parameters()
                if p.requires_grad
            }
        )
        opt.step()
    return grads, {_name(n): p.detach().clone() for n, p in model.named_parameters()}


def pattern_loss(name: str) -> Callable[..., torch.Tensor]:
    pattern = PATTERNS[name]

    def loss(model: nn.Module, inputs: dict[str, Any], step: int, rank: int) -> torch.Tensor:
        return pattern.loss(model, inputs["x"], step, rank)

    return loss


def pattern_fit(rank: int, world: int, name: str, how: str = "distckpt", **kwargs: Any) -> dict[str, Any]:
    """Pattern ``name`` of tests/patterns.py under Trainer, with the reference's model, data and optimizer (AdamW;
    see :func:`fit`). The pattern's micro-batches are ``gradient_accumulation_steps``; ``model_init=True``: the model
    comes from ``Trainer(model_init=...)``."""
    pattern = PATTERNS[name]
    # No argument: Trainer passes its trial to a model_init that takes one.
    model_init = (lambda: build(pattern)) if kwargs.pop("model_init", False) else None
    model = None if model_init else build(pattern)
    if how == "distckpt":
        from distckpt.integrations.hf import DistckptCallback

        options = {"guard_every": 1, **kwargs.pop("options", {})}
        kwargs["callback"] = DistckptCallback(
            blocks=pattern.blocks, reentrant=kwargs.pop("reentrant", False), **options
        )
    opt = make_optimizer if model_init else make_optimizer([p for p in model.parameters() if p.requires_grad])
    return fit(
        rank,
        model,
        PatternData(name, world),
        pattern_loss(name),
        how,
        accumulate=pattern.micro_batches,
        batch_size=1,
        collate=_one_item,
        optimizer=opt,
        model_init=model_init,
        **kwargs,
    )


def sweep(rank: int, world: int, names: list[str], how: str = "distckpt", **kwargs: Any) -> dict[str, dict]:
    """Every pattern of ``names`` in one pool call: {name: pattern_fit's result}."""
    return {name: pattern_fit(rank, world, name, how, **kwargs) for name in names}
