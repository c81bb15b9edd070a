"""The paper's AFT equations (Zhai et al., 2021) as plain float64 NumPy loops, nothing clever:
Y[t, d] = sigmoid(q[t, d]) * sum_t' exp(k[t', d] + w[t, t']) v[t', d] / sum_t' exp(k[t', d] +
w[t, t']) over the allowed t' (causal: t' <= t), only the logits' max subtracted before exp.
"""

import numpy as np


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _weighted(logits, values):
  e = np.exp(logits - logits.max())
  return (e * values).sum() / e.sum()


def aft_full(q, k, v, w, causal=False):
  """q, k, v: [..., T, D]; w: [T, T]."""
  q, k, v, w = (np.asarray(x, np.float64) for x in (q, k, v, w))
  lead = q.shape[:-2]
  t_len, d = q.shape[-2:]
  q, k, v = (x.reshape((-1, t_len, d)) for x in (q, k, v))
  y = np.zeros_like(q)
  for b in range(q.shape[0]):
    for t in range(t_len):
      keys = [tp for tp in range(t_len) if not (causal and tp > t)]
      for c in range(d):
        logits = np.array([k[b, tp, c] + w[t, tp] for tp in keys])
        y[b, t, c] = _sigmoid(q[b, t, c]) * _weighted(logits, v[b, keys, c])
  return y.reshape(lead + (t_len, d))


def local_bias(w, window):  # Eq. 4: w where |t - t'| < window, 0 (not -inf) elsewhere
  out = np.zeros_like(np.asarray(w, np.float64))
  for t in range(len(w)):
    for tp in range(len(w)):
      if abs(t - tp) < window:
        out[t, tp] = w[t, tp]
  return out


def aft_local(q, k, v, w, window, causal=False):
  return aft_full(q, k, v, local_bias(w, window), causal)


def aft_simple(q, k, v, causal=False):
  t_len = np.shape(q)[-2]
  return aft_full(q, k, v, np.zeros((t_len, t_len)), causal)


def conv1d_bias(kernel_row, t_len, causal):
  """The T x T bias of one head: kernel[j] at t' = t + j - s//2 (or t' = t - j if causal)."""
  s = len(kernel_row)
  w = np.zeros((t_len, t_len))
  for t in range(t_len):
    for j in range(s):
      tp = t - j if causal else t + j - s // 2
      if 0 <= tp < t_len:
        w[t, tp] = kernel_row[j]
  return w


def aft_conv1d(q, k, v, kernel, causal=False):
  """q, v: [..., T, H, C]; k: [..., T, H]; kernel: [H, s]."""
  q, k, v, kernel = (np.asarray(x, np.float64) for x in (q, k, v, kernel))
  t_len, heads, ch = q.shape[-3:]
  y = np.zeros_like(q)
  for h in range(heads):
    w = conv1d_bias(kernel[h], t_len, causal)
    for c in range(ch):
      y[..., h, c] = aft_full(q[..., h, c, None], k[..., h, None], v[..., h, c, None], w, causal)[
        ..., 0
      ]
  return y


def aft_conv2d(q, k, v, kernel):
  """q, v: [..., Ht, Wd, H, C]; k: [..., Ht, Wd, H]; kernel: [H, kh, kw] ('SAME')."""
  q, k, v, kernel = (np.asarray(x, np.float64) for x in (q, k, v, kernel))
  ht, wd, heads, ch = q.shape[-4:]
  kh, kw = kernel.shape[1:]
  n = ht * wd
  y = np.zeros_like(q)
  for h in range(heads):
    w = np.zeros((n, n))  # positions flattened row-major
    for r in range(ht):
      for c in range(wd):
        for a in range(kh):
          for b in range(kw):
            rr, cc = r + a - kh // 2, c + b - kw // 2
            if 0 <= rr < ht and 0 <= cc < wd:
              w[r * wd + c, rr * wd + cc] = kernel[h, a, b]
    lead = q.shape[:-4]
    for c in range(ch):
      qf = q[..., h, c].reshape(lead + (n, 1))
      kf = k[..., h].reshape(lead + (n, 1))
      vf = v[..., h, c].reshape(lead + (n, 1))
      y[..., h, c] = aft_full(qf, kf, vf, w).reshape(lead + (ht, wd))
  return y


def aft_decay(q, k, v, decay, bonus=None, segment_ids=None):
  """Causal, w[t, t'] = -decay (t - t') for t' < t, bonus at t' = t, per channel; q, k, v:
  [..., T, D]; decay, bonus: [D]; segment_ids [..., T]: t' only from t's document."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  lead, (t_len, d) = q.shape[:-2], q.shape[-2:]
  decay = np.asarray(decay, np.float64)
  bonus = np.zeros(d) if bonus is None else np.asarray(bonus, np.float64)
  seg = np.zeros(lead + (t_len,)) if segment_ids is None else np.asarray(segment_ids)
  q, k, v = (x.reshape((-1, t_len, d)) for x in (q, k, v))
  seg = np.broadcast_to(seg, lead + (t_len,)).reshape(-1, t_len)
  y = np.zeros_like(q)
  for b in range(q.shape[0]):
    for t in range(t_len):
      first = t
      while first > 0 and seg[b, first - 1] == seg[b, t]:
        first -= 1
      keys = list(range(first, t + 1))
      for c in range(d):
        w = [bonus[c] if tp == t else -decay[c] * (t - tp) for tp in keys]
        logits = np.array([k[b, tp, c] + w[i] for i, tp in enumerate(keys)])
        y[b, t, c] = _sigmoid(q[b, t, c]) * _weighted(logits, v[b, keys, c])
  return y.reshape(lead + (t_len, d))
