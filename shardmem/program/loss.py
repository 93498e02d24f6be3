"""The loss a training program differentiates: ``loss_fn(model, batch)``, ``train.loss``, or next-token
cross-entropy on the reference token batch.

    loss_fn = resolve_loss(config, None, token_batch=True)   # next_token_loss
    loss = next_token_loss(model, tokens_BxL1)

A loss returns a scalar, or ``(loss, metrics)`` with a dict of scalar metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from shardmem.config import Config
from shardmem.errors import ConfigError
from shardmem.models import losses
from shardmem.models.user import import_object, search_from

LossFn = Callable[[nnx.Module, Any], Any]


def next_token_loss(model: nnx.Module, batch_BxL1: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting ``batch[:, 1:]`` from ``batch[:, :-1]``; over chunks of the
    vocabulary for the reference model's ``model.loss_chunk`` (see :mod:`shardmem.models.losses`)."""
    return losses.next_token_loss(model, batch_BxL1)


def resolve_loss(config: Config, loss_fn: LossFn | None, token_batch: bool) -> LossFn:
    """The loss: ``loss_fn``, else ``train.loss``, else next-token cross-entropy on a token batch."""
    if loss_fn is not None:
        return loss_fn
    if config.train.loss is not None:
        with search_from(config.folder):
            return import_object(config.train.loss, "train.loss")
    if not token_batch:
        raise ConfigError(
            "train.loss is not set, and the batch is not the token batch next-token cross-entropy "
            "needs; set train.loss: mypkg.module:loss (loss(model, batch) -> loss or (loss, metrics)) "
            "or pass loss_fn="
        )
    return next_token_loss
