"""Choosing the next token from logits: greedy, or sampled with a temperature, top-k and top-p.

    sampling = Sampling(temperature=0.8, top_k=50, top_p=0.95, seed=0)   # Sampling() is greedy
    tokens_B = sample(logits_BxV, jax.random.fold_in(sampling.key(), step), sampling)

As ``transformers``' ``generate`` applies them: the logits divided by the temperature, then all but the
``top_k`` largest dropped, then all but the fewest most likely tokens whose probabilities sum to at least
``top_p`` (the most likely one always kept), then one token drawn per sequence. A temperature of 0 is
greedy decoding (the largest logit; the other settings do nothing).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from shardmem.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen (see the module docstring); the default is greedy."""

    temperature: float = 0.0  # 0: greedy.
    top_k: int = 0  # Keep the k largest logits (0: all).
    top_p: float = 1.0  # Keep the most likely tokens whose probabilities sum to top_p (1: all).
    seed: int = 0  # Seeds the draws: the same seed, prompts and weights give the same tokens.

    def __post_init__(self):
        if not 0 <= self.temperature < math.inf:  # inf would draw every token alike; NaN any of them.
            raise ConfigError(f"temperature={self.temperature} (--temperature): use 0 (greedy) or a positive "
                              "temperature, e.g. 0.7")  # fmt: skip
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k} (--top-k): use 0 (every token) or the number of tokens to "
                              "keep, e.g. 50")  # fmt: skip
        if not 0 < self.top_p <= 1:
            raise ConfigError(
                f"top_p={self.top_p} (--top-p): use a probability in (0, 1], e.g. 0.9 (1: every token)"
            )
        if not 0 <= self.seed < 1 << 32:  # jax.random.key takes 32 bits: a larger seed would repeat one.
            raise ConfigError(f"seed={self.seed} (--seed): use an integer from 0 to {(1 << 32) - 1}")

    @property
    def greedy(self) -> bool:
        """Whether the largest logit is taken (a temperature of 0)."""
        return self.temperature == 0

    def key(self) -> jax.Array:
        """Returns the PRNG key the draws start from."""
        return jax.random.key(self.seed)


def sample(logits_BxV, key, sampling: Sampling) -> jax.Array:
    """Returns one token per sequence (int32 ``[B]``) drawn from ``logits`` as ``sampling`` says."""
    if sampling.greedy:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits_BxV = logits_BxV.astype(jnp.float32) / sampling.temperature
    if sampling.top_k and sampling.top_k < logits_BxV.shape[-1]:
        kth_Bx1 = jax.lax.top_k(logits_BxV, sampling.top_k)[0][:, -1:]
        logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
    if sampling.top_p < 1:
        sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
        probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
        before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV  # Mass of the likelier tokens.
        kept_BxV = jnp.where(before_BxV < sampling.top_p, sorted_BxV, jnp.inf)
        smallest_Bx1 = jnp.min(kept_BxV, axis=-1, keepdims=True)
        logits_BxV = jnp.where(logits_BxV < smallest_Bx1, -jnp.inf, logits_BxV)
    return jax.random.categorical(key, logits_BxV, axis=-1).astype(jnp.int32)
