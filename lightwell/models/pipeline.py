"""Pipeline stages inside a model: each stage builds only its own layers (the others are
``PPMissingLayer`` placeholders: no parameters, no weights loaded), the first stage the
embedding, the last the final norm and LM head. The model files call these helpers and keep a
plain forward; the activations' sends and receives are the model runner's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from lightwell.distributed.pipeline import is_first_stage, is_last_stage, stage_layers
from lightwell.layers.embedding import VocabParallelEmbedding


class PPMissingLayer(nn.Identity):
    """A module another pipeline stage owns: holds nothing, and is never called."""


def on_stage(present: bool, build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` where this stage needs the module, else a placeholder."""
    return build() if present else PPMissingLayer()


def make_layers(
    num_layers: int, build: Callable[[int], nn.Module]
) -> tuple[int, int, nn.ModuleList]:
    """``(start, end, layers)``: this stage's layers ``[start, end)`` built, the others
    placeholders (indices, and so checkpoint names, as in the whole model)."""
    start, end = stage_layers(num_layers)
    layers = nn.ModuleList(
        build(i) if start <= i < end else PPMissingLayer() for i in range(num_layers)
    )
    return start, end, layers


def stage_embedding(config: Any) -> nn.Module:
    """The token embedding on the first stage (and on the last if the LM head is tied to it),
    a placeholder elsewhere."""
    tied = bool(getattr(config, "tie_word_embeddings", False))
    present = is_first_stage() or (tied and is_last_stage())
    return on_stage(present, lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size))


def skip_missing(model: nn.Module, skip: Callable[[str], bool]) -> Callable[[str], bool]:
    """``skip`` extended to the checkpoint tensors of modules another stage owns."""
    prefixes = tuple(
        f"{name}." for name, m in model.named_modules() if isinstance(m, PPMissingLayer)
    )
    if not prefixes:
        return skip
    return lambda name: name.startswith(prefixes) or skip(name)
