"""Evaluation's config keys and its numbers' names (the evaluation: ``Trainer.evaluate``)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from aft_jax.typed_config import TypedConfig, positive


@dataclasses.dataclass(frozen=True)
class EvalConfig(TypedConfig):
  """Keys at the top of the config tree (``config.eval_batch_size``, ...)."""

  # Before final_eval_stride, the final numbers were scored with eval_stride
  # (TypedConfig.as_written).
  ADDED = {"final_eval_stride": ("f226f96", lambda saved: saved.get("eval_stride"))}

  eval_every_steps: int = 500  # validation perplexity during training
  eval_batch_size: int = 16  # global, in windows of seq_len tokens
  eval_stride: int = 0  # validation during training: > 0 sliding windows, 0 disjoint windows
  # The final valid/test numbers in results.json: 0 disjoint windows of seq_len; S > 0 sliding
  # windows that score S new tokens each (1: every token with seq_len - 1 tokens of context)
  final_eval_stride: int = 0

  def _value_problems(self) -> list[str]:
    # Strides above seq_len are refused where seq_len is known (the config check).
    errors = positive(self, "eval_every_steps", "eval_batch_size")
    for name in ("eval_stride", "final_eval_stride"):
      if getattr(self, name) < 0:
        errors.append(f"config.{name} = {getattr(self, name)} must be >= 0 (0: disjoint windows)")
    return errors


def perplexity(nll: float) -> float:
  """exp(nll); inf where that overflows (a diverged model), so results are still written."""
  try:
    return math.exp(nll)
  except OverflowError:
    return math.inf


def bits_per_byte(nll: float, tokens: int, num_bytes: int) -> float:
  """Bits per byte of the text the ``tokens`` stand for: vocabularies of any size compare."""
  return nll * tokens / (num_bytes * math.log(2))


def eval_protocol(seq_len: int, stride: int) -> dict:
  """How an evaluation scored its tokens, as recorded next to the numbers in results.json."""
  if not stride or stride >= seq_len:
    return {"name": "disjoint_windows", "window": seq_len, "stride": seq_len}
  return {"name": "sliding_window", "window": seq_len, "stride": stride}


def unigram_ppl(train_tokens: np.ndarray, eval_tokens: np.ndarray, vocab_size: int) -> float:
  """Perplexity of the training split's add-one-smoothed unigram distribution on eval_tokens."""
  counts = np.bincount(train_tokens, minlength=vocab_size).astype(np.float64)
  logp = np.log((counts + 1.0) / (counts.sum() + vocab_size))
  return float(np.exp(-logp[eval_tokens].mean()))
