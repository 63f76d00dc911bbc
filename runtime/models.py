"""Models the runtime executes: a GPT-style decoder split into pipeline stages, or a user's model.

A :class:`PipelineModel` is what the executor needs of a model: a builder for the module of each model
stage (deterministic from a seed, so every rank and the single-process reference build identical
weights without exchanging them), a synthetic ``(input, target)`` batch per microbatch (deterministic
from a seed) and the loss. The built-in decoder (token + position embedding, ``num_layers`` pre-norm
transformer blocks, final LayerNorm, LM head, cross-entropy) follows the layout of the Zero Bubble
paper's models (arXiv 2401.10241, Table 3; notation h, a, s, b, L, V of Table 1).

Layers per stage come from ``problem.model.layers_per_stage`` when given; otherwise they are
balanced, the embedding sitting on the first model stage and LM head + loss on the last, which get
the fewer layers when ``L`` does not divide evenly.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.optimizer.problem import Problem

__all__ = [
    "PRESETS",
    "GPTConfig",
    "GPTStage",
    "PipelineModel",
    "balanced_layers",
    "gpt_model",
    "lm_loss",
    "load_model",
]


@dataclass(frozen=True)
class GPTConfig:
    """Decoder sizes (Zero Bubble paper, Table 1 notation).

    Attributes:
        vocab_size: V. seq_length: s, tokens. hidden_size: h. num_heads: a. num_layers: L.
        micro_batch_size: b, sequences per microbatch. ffn_hidden_size: MLP inner size (None: 4h).
    """

    vocab_size: int
    seq_length: int
    hidden_size: int
    num_heads: int
    num_layers: int
    micro_batch_size: int = 1
    ffn_hidden_size: int | None = None


#: Named sizes for ``--model``: ``gpt-tiny`` runs the CPU tests in milliseconds; ``gpt-1.5b`` is the
#: Zero Bubble paper's 1.5B setting (h 2304, a 24, s 1024) with 24 layers (≈1.5·10⁹ parameters).
PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(vocab_size=64, seq_length=8, hidden_size=16, num_heads=2, num_layers=8, micro_batch_size=2),
    "gpt-small": GPTConfig(
        vocab_size=4096, seq_length=128, hidden_size=256, num_heads=4, num_layers=8, micro_batch_size=2
    ),
    "gpt-350m": GPTConfig(vocab_size=50257, seq_length=1024, hidden_size=1024, num_heads=16, num_layers=24),
    "gpt-1.5b": GPTConfig(vocab_size=50257, seq_length=1024, hidden_size=2304, num_heads=24, num_layers=24),
}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one microbatch: logits ``(b, s, V)``, targets ``(b, s)`` → scalar."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and a GELU MLP, each with a residual."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_heads
        self.ln_attention = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.projection = nn.Linear(h, h)
        self.ln_mlp = nn.LayerNorm(h)
        ffn = config.ffn_hidden_size or 4 * h
        self.fc_in = nn.Linear(h, ffn)
        self.fc_out = nn.Linear(ffn, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(b, s, h)`` → ``(b, s, h)``."""
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln_attention(x)).split(h, dim=-1)
        heads = [t.view(b, s, self.num_heads, h // self.num_heads).transpose(1, 2) for t in (q, k, v)]
        attended = F.scaled_dot_product_attention(heads[0], heads[1], heads[2], is_causal=True)
        x = x + self.projection(attended.transpose(1, 2).reshape(b, s, h))
        return x + self.fc_out(F.gelu(self.fc_in(self.ln_mlp(x))))


class GPTStage(nn.Module):
    """One model stage: optional embedding, ``num_layers`` blocks, optional final norm + LM head.

    Input: token ids ``(b, s)`` int64 on the first stage, hidden states ``(b, s, h)`` otherwise.
    Output: logits ``(b, s, V)`` on the last stage, hidden states ``(b, s, h)`` otherwise.
    """

    def __init__(self, config: GPTConfig, num_layers: int, *, first: bool, last: bool) -> None:
        super().__init__()
        self.config = config
        self.first, self.last = first, last
        if first:
            self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
            self.position_embedding = nn.Embedding(config.seq_length, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(num_layers))
        if last:
            self.ln_final = nn.LayerNorm(config.hidden_size)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the stage on one microbatch (shapes in the class docstring)."""
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.token_embedding(x) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_final(x))
        return x


def balanced_layers(num_layers: int, num_stages: int) -> list[int]:
    """Layers per model stage: as even as possible, the first and last stage (embedding, LM head)
    getting the fewer layers when ``num_layers`` is not a multiple of ``num_stages``.

    Raises:
        ValueError: when there are fewer layers than stages.
    """
    if num_layers < num_stages:
        raise ValueError(
            f"the model has {num_layers} layers but the pipeline has {num_stages} stages: every stage needs "
            "at least one layer; use a model with more layers or fewer stages"
        )
    base, extra = divmod(num_layers, num_stages)
    # Middle stages first, then the ends, receive the remainder.
    preference = [*range(1, num_stages - 1), 0, num_stages - 1] if num_stages > 2 else list(range(num_stages))
    counts = [base] * num_stages
    for stage in preference[:extra]:
        counts[stage] += 1
    return counts


@dataclass
class PipelineModel:
    """A model as the runtime sees it.

    Attributes:
        name: for reports.
        num_model_stages: model stages (chunks); stage ids of bidirectional schedules map onto them.
        build_stage: model stage → its module, identical on every call (seeded).
        make_microbatch: microbatch index → ``(input, target)`` tensors, identical on every call.
        loss_fn: ``(last stage output, target)`` → scalar loss of one microbatch; the step's loss is
            the mean over microbatches.
        layers_per_stage: transformer layers per model stage (``None`` for user models).
        config: the decoder's sizes (``None`` for user models).
    """

    name: str
    num_model_stages: int
    build_stage: Callable[[int], nn.Module]
    make_microbatch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    layers_per_stage: list[int] | None = None
    config: GPTConfig | None = None


def _token_batch(vocab_size: int, seq_length: int, micro_batch_size: int, seed: int, microbatch: int):
    generator = torch.Generator().manual_seed(seed * 1_000_003 + microbatch)
    tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_length + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def gpt_model(config: GPTConfig, num_stages: int, *, seed: int = 0, layers_per_stage: list[int] | None = None):
    """The decoder of ``config`` split into ``num_stages`` model stages.

    Stage s's weights come from ``torch.manual_seed(seed · 7919 + s)`` in a forked RNG, so they depend on
    (seed, stage, layers of the stage) only. Token batches: uniform ids from a generator seeded by
    (seed, microbatch); the target is the input shifted by one token.

    ``layers_per_stage`` may give the first or the last stage 0 layers (the embedding or the LM head
    alone), as the problem's partition allows; every other stage needs at least one.

    Raises:
        ValueError: when ``layers_per_stage`` does not list ``num_stages`` counts, or a middle stage has none.
    """
    if layers_per_stage is None:
        layers_per_stage = balanced_layers(config.num_layers, num_stages)
    elif len(layers_per_stage) != num_stages or any(
        count < 0 or (count == 0 and 0 < stage < num_stages - 1) for stage, count in enumerate(layers_per_stage)
    ):
        raise ValueError(
            f"model.layers_per_stage must list one layer count per model stage ({num_stages}), at least one "
            f"on every stage but the first and the last, got {layers_per_stage}"
        )
    counts = list(layers_per_stage)

    def build_stage(stage: int) -> nn.Module:
        if not 0 <= stage < num_stages:
            raise ValueError(f"model stage {stage} out of range 0 … {num_stages - 1}")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 7919 + stage)
            return GPTStage(config, counts[stage], first=stage == 0, last=stage == num_stages - 1)

    def make_microbatch(microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _token_batch(config.vocab_size, config.seq_length, config.micro_batch_size, seed, microbatch)

    return PipelineModel(
        name=f"gpt(L={sum(counts)}, h={config.hidden_size}, a={config.num_heads}, s={config.seq_length}, "
        f"V={config.vocab_size}, b={config.micro_batch_size})",
        num_model_stages=num_stages,
        build_stage=build_stage,
        make_microbatch=make_microbatch,
        loss_fn=lm_loss,
        layers_per_stage=counts,
        config=config,
    )


def _user_model(spec: str, num_stages: int, seed: int) -> PipelineModel:
    module_name, _, function_name = spec.partition(":")
    # As `python -m` does: modules in the current directory import without PYTHONPATH=.
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(
            f"--model {spec!r}: cannot load {function_name!r} from module {module_name!r}: {error} (the module is "
            "looked up in the current directory and on PYTHONPATH)"
        ) from None
    if not callable(function):
        raise ValueError(f"--model {spec!r}: {module_name}.{function_name} is not a function")
    try:
        built = function(num_stages, seed)
    except Exception as error:
        raise ValueError(
            f"--model {spec!r}: calling {module_name}.{function_name}(num_stages={num_stages}, seed={seed}) failed "
            f"with {type(error).__name__}: {error}; --model module:function names a function build(num_stages, "
            "seed) returning one nn.Module per stage (or a PipelineModel)"
        ) from None
    if isinstance(built, PipelineModel):
        return built
    if not isinstance(built, Sequence) or not all(isinstance(m, nn.Module) for m in built):
        raise ValueError(
            f"--model {spec!r}: the function must return a pipesched.runtime.models.PipelineModel or a list of "
            f"{num_stages} nn.Module stages, got {type(built).__name__}"
        )
    stages = list(built)
    if len(stages) != num_stages:
        raise ValueError(f"--model {spec!r} returned {len(stages)} stage modules, the schedule has {num_stages}")
    embeddings = [m for m in stages[0].modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise ValueError(
            f"--model {spec!r}: with a plain list of stages the first stage must take token ids (hold an "
            "nn.Embedding); return a pipesched.runtime.models.PipelineModel to give your own inputs"
        )
    vocab = embeddings[0].num_embeddings
    return PipelineModel(
        name=spec,
        num_model_stages=num_stages,
        build_stage=lambda stage: stages[stage],
        make_microbatch=lambda microbatch: _token_batch(vocab, 16, 2, seed, microbatch),
        loss_fn=lm_loss,
    )


def load_model(name: str, problem: Problem, *, seed: int = 0) -> PipelineModel:
    """The model called ``name`` for ``problem``'s model stages.

    ``name`` is a preset (:data:`PRESETS`), ``"problem"`` (the sizes in ``problem.model``), or
    ``"module:function"``: ``function(num_stages, seed)`` returning a :class:`PipelineModel` or a list of
    stage modules (the first taking token ids ``(2, 16)``, the last returning logits). A preset or
    ``problem`` takes ``problem.model.layers_per_stage`` when the problem gives it.

    Raises:
        ValueError: unknown name, a model that cannot be split into the problem's stages.
    """
    num_stages = problem.pipeline.num_stages
    layers = problem.model.layers_per_stage if problem.model is not None else None
    if ":" in name:
        return _user_model(name, num_stages, seed)
    if name == "problem":
        if problem.model is None:
            raise ValueError('--model problem needs a problem with a "model" section; name a preset instead')
        m = problem.model
        config = GPTConfig(
            vocab_size=m.vocab_size,
            seq_length=m.seq_length,
            hidden_size=m.hidden_size,
            num_heads=m.num_attention_heads,
            num_layers=m.num_layers,
            micro_batch_size=m.micro_batch_size,
            ffn_hidden_size=m.ffn_hidden_size,
        )
    elif name in PRESETS:
        config = PRESETS[name]
        if layers is not None and sum(layers) != config.num_layers:
            config = GPTConfig(**{**config.__dict__, "num_layers": sum(layers)})
    else:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(PRESETS)}, 'problem', or module:function")
    if config.hidden_size % config.num_heads:
        raise ValueError(f"hidden size {config.hidden_size} is not a multiple of {config.num_heads} heads")
    if name in PRESETS and layers is None and config.num_layers < num_stages:
        # Deepen a preset so that every stage holds one layer (e.g. gpt-tiny on 16 stages).
        config = GPTConfig(**{**config.__dict__, "num_layers": num_stages * math.ceil(config.num_layers / num_stages)})
    return gpt_model(config, num_stages, seed=seed, layers_per_stage=layers)
