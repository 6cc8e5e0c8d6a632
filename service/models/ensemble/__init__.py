"""The ensemble kind: a pipeline of served models, run step by step (model.py)."""

from __future__ import annotations

from service.errors import ConfigError
from service.models.catalog import Context, Kind, ServedVersion
from service.models.ensemble.model import EnsembleModel
from service.repository.layout import ModelConfig

__all__ = ["KIND", "EnsembleModel"]


def _build(config: ModelConfig, context: Context) -> ServedVersion:
    if config.ensemble is None:
        raise ConfigError(
            "ensemble_scheduling", f"model '{config.name}': an ensemble needs ensemble_scheduling (its steps)"
        )
    return EnsembleModel(config, context.steps, context.observer)


KIND = Kind(_build, sections=("ensemble_scheduling",), platforms=("ensemble",))
