"""TRL's ``GRPOTrainer`` on the ranks of the test pool (tests/harness.py) and in one process, for
tests/integrations/test_trl.py: the model, tokenizer and LoRA of tests/integrations/trl_fit.py, prompts of one length
(no left padding, so a row's positions do not depend on the rows beside it), a reward function in Python.

GRPO samples its completions. In one process a run with distckpt and one without draw the same completions from the
same seed (the test checks they do). Across layouts the draws differ (each rank samples its rows from its own
generator), so :class:`SeededGRPOTrainer` seeds each rank-sized chunk of a generation batch from (step, chunk) inside
``torch.random.fork_rng``: a rank and the one process that generates all the chunks then draw the same completions,
and the global generator is left as TRL leaves it. Every run is SGD at a constant rate, no clipping.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from accelerate_fit import kept_environ
from hf_fit import HF_CKPT, PLAIN_SGD, Record
from trl_fit import VOCAB, lora, tiny_llama, tokenizer, trained

STEPS = 2  # optimizer steps
BATCH = 2  # completions per rank per step
GENERATIONS = 4  # completions per prompt: a group spans both ranks of the pool
PROMPT_WORDS = 4
COMPLETION = 4  # tokens generated at most
LR = 0.1

# "lora": TRL's LoRA; the reference log-probabilities (beta > 0) from the same model with its adapters disabled,
# under no_grad; a generation every step; an evaluation after each step (generation and loss on an eval set, the
# model in eval mode, in the middle of train()). "full": every parameter trained, the model given as a local
# directory, so that TRL loads its reference model from there too (a separate model, prepared by Accelerate for
# evaluation, not checkpointed); num_iterations=2: one generation serves both steps, their old log-probabilities from
# a forward without gradients, so the second step's ratio is not 1. At LR the full model's second-step ratios all
# leave PPO's clip range and its gradient is zero, so it trains at LR / 100.
KINDS = {
    "lora": {"beta": 0.04, "learning_rate": LR},
    "full": {"beta": 0.04, "num_iterations": 2, "learning_rate": LR / 100},
}


def even_words(completions: list[str], **kwargs: Any) -> list[float]:
    """The reward: how many words of the completion have an even index (``w0``, ``w2``, ...), a Python function."""
    return [float(sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in c.split())) for c in completions]


def dataset(n: int) -> Any:
    """``n`` prompts of ``PROMPT_WORDS`` words, the same in every process."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB - 3, (n, PROMPT_WORDS), generator=g)
    return Dataset.from_list([{"prompt": " ".join(f"w{int(i)}" for i in row)} for row in ids])


def config(out: str, batch: int, kind: str, **kw: Any) -> Any:
    """TRL's ``GRPOConfig`` with its defaults (``gradient_checkpointing=True``, sampling at temperature 1) unless
    ``kw``; generation by ``model.generate`` (no vLLM)."""
    from trl import GRPOConfig

    if kind == "lora":
        kw = {"eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": batch, **kw}
    return GRPOConfig(
        **PLAIN_SGD,
        output_dir=out,
        bf16=False,
        use_vllm=False,
        per_device_train_batch_size=batch,
        num_generations=GENERATIONS,
        max_completion_length=COMPLETION,
        max_steps=STEPS,
        **{**KINDS[kind], **kw},
    )


def saved(model: Any, path: str) -> str:
    """``model`` written to ``path``, a directory TRL loads it from. Not ``save_pretrained``, which writes on rank 0 of
    a process group only (transformers 5.25), while each rank here loads from a directory of its own."""
    from safetensors.torch import save_file

    model.config.architectures = [type(model).__name__]  # as save_pretrained records it; TRL loads by it
    model.config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{path}/model.safetensors")
    return path


def trainer_class(seeded: bool, distckpt_trainer: bool) -> type:
    from trl import GRPOTrainer

    cls = seeded_trainer() if seeded else GRPOTrainer
    if distckpt_trainer:
        from distckpt.integrations.hf import with_distckpt

        return with_distckpt(cls)
    return cls


_SEEDED: list[type] = []


def seeded_trainer() -> type:
    """``SeededGRPOTrainer``: TRL's ``GRPOTrainer`` whose generation draws each chunk of ``BATCH`` rows from a
    generator seeded by (optimizer step, the chunk's index in the global generation batch), made once."""
    if _SEEDED:
        return _SEEDED[0]
    from trl import GRPOTrainer

    class SeededGRPOTrainer(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, **kw):  # noqa: ANN001
            chunks = len(prompt_ids) // BATCH
            first = self.accelerator.process_index * chunks  # the global index of this process's first chunk
            completions: list[list[int]] = []
            for c in range(chunks):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(1000 * self.state.global_step + first + c)
                    ids, _ = super()._generate_single_turn(
                        prompt_ids[c * BATCH : (c + 1) * BATCH], images, multimodal_fields, num_generations, **kw
                    )
                completions += ids
            return completions, None

    _SEEDED.append(SeededGRPOTrainer)
    return SeededGRPOTrainer


def fit(
    rank: int, world: int, kind: str, how: str, *, seeded: bool = False, reentrant: bool = False,
    batch: int = BATCH, **cfg: Any,
) -> dict[str, Any]:  # fmt: skip
    """TRL's ``GRPOTrainer`` (``seeded``: :func:`seeded_trainer`), ``kind`` of :data:`KINDS`, ``STEPS`` steps, on
    this rank. ``how``: "distckpt" (``with_distckpt(GRPOTrainer)`` and ``DistckptCallback(reentrant=reentrant,
    guard_every=1)``, TRL's checkpointing default left on for distckpt to take over), "none" (TRL, no
    checkpointing). {"grads", "params", "completions", "checkpointed", "hf_checkpointing", "find_unused",
    "log_history"} or {"error", "message"}; "completions": this rank's completion token ids, per generation
    (training's and evaluation's, in order)."""
    from distckpt.integrations.hf import DistckptCallback

    rec = Record()
    callbacks: list[Any] = [rec]
    if how == "distckpt":
        callbacks.append(DistckptCallback(guard_every=1, reentrant=reentrant))
    else:
        cfg[HF_CKPT] = False
    drawn: list[list[list[int]]] = []  # this rank's completion ids, per generation

    def reward(completions: list[str], completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        drawn.append([list(ids) for ids in completion_ids])
        return even_words(completions)

    reward.__name__ = "even_words"
    with tempfile.TemporaryDirectory() as out, kept_environ():

        def train() -> Any:
            model: Any = tiny_llama()
            if kind == "full":
                model = saved(model, f"{out}/model")
            trainer = trainer_class(seeded, how == "distckpt")(
                model=model,
                reward_funcs=reward,
                args=config(out, batch, kind, **cfg),
                train_dataset=dataset(8),
                eval_dataset=dataset(2) if kind == "lora" else None,
                processing_class=tokenizer(),
                peft_config=lora() if kind == "lora" else None,
                callbacks=callbacks,
            )
            trainer.train()
            return trainer

        result = trained(train, rec)
    return result if "error" in result else {**result, "completions": drawn}


def sweep(rank: int, world: int, cases: list[tuple[str, str, bool, int]]) -> dict[tuple, dict]:
    """Every ``(kind, how, reentrant, gradient_accumulation_steps)`` of ``cases`` with :func:`seeded_trainer`, in one
    pool call."""
    return {
        case: fit(rank, world, case[0], case[1], seeded=True, reentrant=case[2], gradient_accumulation_steps=case[3])
        for case in cases
    }
