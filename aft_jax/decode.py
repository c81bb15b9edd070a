"""Sampling from a trained language model: incremental decoding, past ``max_len`` a sliding
context; a stream decodes at any position. docs/training.md, "After training" and "Streams"."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from aft_jax.model import CHUNKED, STREAM, check_ids
from aft_jax.typed_config import TypedConfig


def sampling_problems(temperature: float, top_k: int, top_p: float) -> list[str]:
  """One line per bad sampling argument ("top_k = -1 must be ...")."""
  checks = (
    (temperature >= 0, f"temperature = {temperature} must be >= 0 (0: greedy)"),
    (top_k >= 0, f"top_k = {top_k} must be >= 0 (0: all tokens)"),
    (0 < top_p <= 1, f"top_p = {top_p} must be in (0, 1] (1: all tokens)"),
  )
  return [message for ok, message in checks if not ok]


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
  errors = sampling_problems(temperature, top_k, top_p)
  if errors:
    raise ValueError(errors[0])


@dataclasses.dataclass(frozen=True)
class SampleConfig(TypedConfig):
  """``config.sample``: the sample a training run prints at its end (``train_lib.sample``)."""

  WHERE = "sample"

  prompt: str = ""  # text to continue ('' starts after an end-of-line)
  length: int = 200  # tokens to generate (0: no sample)
  temperature: float = 0.8  # 0: greedy
  top_k: int = 0  # sample among the k most likely tokens (0: all)

  def _value_problems(self) -> list[str]:
    errors = [] if self.length >= 0 else [f"{self.key('length')} = {self.length} must be >= 0"]
    return errors + [
      f"config.sample.{e}" for e in sampling_problems(self.temperature, self.top_k, 1)
    ]


def sample_logits(rng, logp_BV, temperature: float, top_k: int = 0, top_p: float = 1.0):
  """Token ids ``[B]`` from log-probabilities ``[B, V]`` (greedy at temperature 0); ``top_k`` > 0
  keeps the k most likely, ``top_p`` < 1 the fewest most likely that sum to ``top_p``."""
  if temperature <= 0:
    return jnp.argmax(logp_BV, axis=-1)
  # The most likely token's logit 0: a tiny temperature (1e-45) sends the others to -inf (greedy),
  # not every logit.
  logits_BV = (logp_BV - jnp.max(logp_BV, axis=-1, keepdims=True)) / temperature
  if top_k and top_k < logits_BV.shape[-1]:
    kth = jax.lax.top_k(logits_BV, top_k)[0][..., -1:]
    logits_BV = jnp.where(logits_BV < kth, -jnp.inf, logits_BV)
  if top_p < 1.0:
    sorted_BV = jnp.sort(logits_BV, axis=-1)[..., ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # mass of the more likely tokens
    # The smallest logit still kept: the last one whose predecessors hold < top_p.
    cutoff_B1 = jnp.min(jnp.where(before_BV < top_p, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    logits_BV = jnp.where(logits_BV < cutoff_B1, -jnp.inf, logits_BV)
  return jax.random.categorical(rng, logits_BV, axis=-1)


# A stream's tokens fetched to the host at a time (``generate``, without a stop_id).
_BLOCK = 64

_sample_jit = jax.jit(sample_logits, static_argnames=("temperature", "top_k", "top_p"))


@dataclasses.dataclass
class Stream:
  """Where a stream stopped: its cache, ``last_B`` (int32 ``[B]``, not yet fed), the next key."""

  cache: Any
  last_B: np.ndarray
  rng: jax.Array

  @property
  def position(self) -> int:
    """The tokens of the stream so far, its last one included."""
    return int(self.cache["pos"]) + 1


# Module-level, the model a static argument: repeated calls on one model compile once.
@functools.partial(
  jax.jit,
  static_argnums=(0,),
  static_argnames=("temperature", "top_k", "top_p"),
  donate_argnums=(2,),
)
def _step_and_sample(model, params, cache, tok_B, rng, *, temperature, top_k, top_p):
  """(new cache, the next tokens [B], the next key) after feeding ``tok_B``."""
  logp_B1V, mutated = model.apply(
    {"params": params, "cache": cache}, tok_B[:, None], decode=True, mutable=["cache"]
  )
  rng, sub = jax.random.split(rng)
  return mutated["cache"], sample_logits(sub, logp_B1V[:, 0], temperature, top_k, top_p), rng


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _prefill(model, params, cache, tokens_BT):
  """The cache after ``tokens_BT``: one step, or one parallel pass (``CHUNKED``)."""
  _, mutated = model.apply(
    {"params": params, "cache": cache}, tokens_BT, decode=True, mutable=["cache"]
  )
  return mutated["cache"]


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _score_chunk(model, params, cache, inputs_BT, targets_BT):
  """(the cache after ``inputs_BT``, the NLL ``[B, T]`` of ``targets_BT``)."""
  nll_BT, mutated = model.apply(
    {"params": params, "cache": cache}, inputs_BT, targets_BT, decode=True, mutable=["cache"]
  )
  return mutated["cache"], nll_BT


@functools.partial(jax.jit, static_argnums=(0, 1))
def init_cache(model, batch: int):
  """The decoding cache of ``batch`` rows before any token (the parameters are dropped)."""
  tokens_B1 = jnp.zeros((batch, 1), jnp.int32)
  return model.init(jax.random.key(0), tokens_B1, decode=True)["cache"]


@functools.partial(jax.jit, static_argnums=(0,))
def _window_logp(model, params, tokens_BT):
  """Log-probabilities ``[B, V]`` of the token after the window ``tokens_BT``."""
  return model.apply({"params": params}, tokens_BT)[:, -1]


def _after(model, params, prompt_BP, stream: Stream | None = None):
  """(cache, last token ``[B]``) after ``prompt_BP`` fed from the start or after ``stream``."""
  if stream is None:
    cache, feed_BT = init_cache(model, prompt_BP.shape[0]), prompt_BP[:, :-1]
  else:
    cache = jax.tree.map(jnp.copy, stream.cache)  # the steps donate theirs
    if prompt_BP.shape[1] == 0:
      return cache, stream.last_B
    feed_BT = np.concatenate([stream.last_B[:, None], prompt_BP[:, :-1]], axis=1)
  size = model.cfg.max_len if model.cfg.mixing in CHUNKED else 1  # else token by token
  for i in range(0, feed_BT.shape[1], size):
    cache = _prefill(model, params, cache, jnp.asarray(feed_BT[:, i : i + size]))
  return cache, prompt_BP[:, -1]


def generate(
  model, params, prompt_BP, length: int, *, rng=None, temperature: float = 1.0, top_k: int = 0,
  top_p: float = 1.0, stop_id: int | None = None, stream: Stream | None = None,
  return_stream: bool = False,
):  # fmt: skip
  """Continues ``prompt_BP`` (int ``[B, P]``, P >= 1) by ``length`` tokens: ``[B, length]``.

  ``stop_id``: stop once every row has produced it (cut each row at its first). Streams only:
  ``stream`` continues a ``Stream`` (P may be 0; ``rng`` defaults to its key);
  ``return_stream``: ``(tokens, Stream)``, which ``stream=`` continues exactly.
  """
  prompt_BP = np.asarray(prompt_BP, np.int32)
  p_min = 0 if stream is not None else 1
  if prompt_BP.ndim != 2 or prompt_BP.shape[1] < p_min:
    raise ValueError(f"generate: prompt must be [B, P] with P >= {p_min}, got {prompt_BP.shape}")
  if length < 0:
    raise ValueError(f"generate: length = {length} must be >= 0")
  check_sampling(temperature, top_k, top_p)
  cfg = model.cfg
  check_ids("generate: prompt", prompt_BP, cfg.vocab_size)
  if (stream is not None or return_stream) and not cfg.streams:
    raise ValueError(
      f"generate: a Stream is the state of a stream ({STREAM}), not of mixing "
      f"{cfg.mixing!r} with position embedding {cfg.position_embedding!r}"
    )
  b, p = prompt_BP.shape
  if stream is not None and stream.last_B.shape != (b,):
    raise ValueError(f"generate: the stream has {stream.last_B.shape[0]} rows, the prompt {b}")
  if rng is None:
    if stream is None:
      raise ValueError("generate: rng is needed (a key), unless a stream gives its own")
    rng = stream.rng
  how = dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
  step = functools.partial(_step_and_sample, model, params, **how)

  seq_BN = np.zeros((b, p + length), np.int32)  # the prompt, then the new tokens
  seq_BN[:, :p] = prompt_BP
  n = p  # tokens in seq_BN so far
  stopped_B = np.zeros(b, bool)

  def append(tok_B):
    nonlocal n, stopped_B
    seq_BN[:, n] = tok_B
    n += 1
    if stop_id is not None:
      stopped_B = stopped_B | (seq_BN[:, n - 1] == stop_id)

  def done():
    return n - p >= length or (stop_id is not None and stopped_B.all())

  if cfg.streams:
    cache, last_B = _after(model, params, prompt_BP, stream)
    last_B = jnp.asarray(last_B)
    # Without a stop_id no step waits for its token: they come to the host in blocks.
    pending = []
    while not done():
      cache, last_B, rng = step(cache, last_B, rng)
      pending.append(last_B)
      if stop_id is not None or len(pending) == _BLOCK or n + len(pending) - p >= length:
        for tok_B in jax.device_get(pending):
          append(tok_B)
        pending = []
    new_BN = seq_BN[:, p:n]
    return (new_BN, Stream(cache, np.asarray(last_B), rng)) if return_stream else new_BN

  max_len = cfg.max_len
  if p <= max_len and not done():
    # Incremental decoding while token n still has a position: n < max_len.
    cache, _ = _after(model, params, prompt_BP)
    while not done():
      cache, tok_B, rng = step(cache, jnp.asarray(seq_BN[:, n - 1]), rng)
      append(np.asarray(tok_B))
      if n > max_len:
        break  # the next token has no position left: slide from here
  sample = functools.partial(_sample_jit, **how)
  while not done():
    rng, sub = jax.random.split(rng)
    window_BT = jnp.asarray(seq_BN[:, n - max_len : n])
    append(np.asarray(sample(sub, _window_logp(model, params, window_BT))))
  return seq_BN[:, p:n]


def score_stream(model, params, tokens, bos_id: int, chunk: int) -> dict:
  """{"nll": mean NLL per token, "tokens"}: token i given ``bos_id`` and tokens 0 .. i-1."""
  if not model.cfg.streams:
    raise ValueError(
      f"score_stream: mixing {model.cfg.mixing!r} with position embedding "
      f"{model.cfg.position_embedding!r} is no stream: it scores in windows of its max_len"
    )
  tokens = np.asarray(tokens, np.int32)
  n = len(tokens)
  if n == 0:
    raise ValueError("score_stream: nothing to score: the text has no tokens")
  check_ids("score_stream: tokens", tokens, model.cfg.vocab_size)
  check_ids("score_stream: bos_id", bos_id, model.cfg.vocab_size)
  num_chunks = -(-n // chunk)
  inputs = np.zeros(num_chunks * chunk, np.int32)
  targets = np.zeros(num_chunks * chunk, np.int32)
  inputs[0], inputs[1:n], targets[:n] = bos_id, tokens[:-1], tokens
  cache = init_cache(model, 1)
  total = 0.0
  for i in range(num_chunks):
    part = slice(i * chunk, (i + 1) * chunk)
    cache, nll_BT = _score_chunk(model, params, cache, inputs[None, part], targets[None, part])
    total += float(np.sum(np.asarray(nll_BT, np.float64)[0, : max(0, n - i * chunk)]))
  return {"nll": total / n, "tokens": n}


def encode_prompt(vocab, prompt: str) -> tuple[list[int], int]:
  """(ids, number of words mapped to ``<unk>``) of ``prompt``; empty: one end-of-line token."""
  from aft_jax.data import vocab as vocab_lib  # pylint: disable=g-import-not-at-top

  if not prompt:
    return [vocab.eos_id], 0
  ids = [int(i) for i in vocab.encode(prompt)]
  unknown = 0
  if isinstance(vocab, vocab_lib.WordVocab):
    known = set(vocab.tokens)
    unknown = sum(t not in known for t in vocab_lib.word_tokens(prompt))
    if not prompt.endswith("\n"):
      ids = ids[:-1]  # the word protocol ends an unterminated line with <eos>: continue the line
  return ids or [vocab.eos_id], unknown


def sample_texts(
  model, params, vocab, prompt: str, length: int, *, num_samples: int = 1,
  stop_at_eos: bool = False, seed: int | None = None, stream: Stream | None = None,
  return_stream: bool = False, **sampling,
):  # fmt: skip
  """``num_samples`` texts (one batch) that continue ``prompt``, without it.

  ``stop_at_eos``: each ends at its first end of line, kept. ``sampling``: as ``generate``
  (temperature 0.8 here); ``seed`` (None: 0, or the stream's key); ``stream``,
  ``return_stream``: as ``generate``.
  """
  if num_samples < 1:
    raise ValueError(f"num_samples = {num_samples} must be >= 1")
  if stream is not None and stream.last_B.shape[0] != num_samples:
    raise ValueError(f"num_samples = {num_samples}: the state holds {stream.last_B.shape[0]}")
  check_batch_fits(model, num_samples)
  ids = encode_prompt(vocab, prompt)[0] if prompt or stream is None else []
  rng = None if seed is None and stream is not None else jax.random.key(seed or 0)
  prompt_BP = np.tile(np.asarray(ids, np.int32)[None], (num_samples, 1))
  stop_id = vocab.eos_id if stop_at_eos else None
  how = dict(rng=rng, stop_id=stop_id, stream=stream, return_stream=return_stream)
  out = generate(model, params, prompt_BP, length, **{"temperature": 0.8, **sampling}, **how)
  new_BN, after = out if return_stream else (out, None)
  texts = []
  for ids in map(list, new_BN):
    if stop_id in ids:
      ids = ids[: ids.index(stop_id) + 1]
    text = vocab.decode(ids)
    texts.append(" " + text if vocab.unit == "word" and text else text)  # words: space-separated
  return (texts, after) if return_stream else texts


def check_batch_fits(model, batch: int) -> None:
  """A ValueError where ``batch`` rows decoded at once (caches, log-probs) outgrow the device."""
  cache = jax.eval_shape(functools.partial(init_cache, model, 1))
  per_row = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache))
  per_row += 3 * 4 * model.cfg.vocab_size  # the step's float32 logits, log-probs and sampling
  stats = jax.devices()[0].memory_stats() or {}  # a GPU's or TPU's limit; a CPU: the RAM
  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  need, have = batch * per_row, int(stats.get("bytes_limit", ram))
  if need > have:
    raise ValueError(
      f"num_samples = {batch}: the samples are decoded as one batch, which needs about "
      f"{need / 2**30:,.1f} GiB here, more than the device's {have / 2**30:,.1f} GiB; ask for "
      "fewer"
    )


def sample_text(model, params, vocab, prompt: str, length: int, **kwargs) -> str:
  """One text that continues ``prompt`` (keyword arguments as ``sample_texts``)."""
  return sample_texts(model, params, vocab, prompt, length, **kwargs)[0]
