"""Every op x impl x JAX transformation, composed, against a dense jax.numpy reference."""

import functools
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from aft_jax import layers, ops
from aft_jax.ops import conv, decay, local, simple
from tests.support import prefork
from tests.support import numpy_reference as ref
from tests.support.op_cases import dense_mean, dense_op, key_mask, segments, tpu_simple

B = 4  # nested vmap: 2 x 2
WINDOW, KERNEL = 3, 3
HEADS, CH = 2, 4  # AFT-conv: heads, channels per head
IMG = (4, 4)  # AFT-conv2d's image
TOL = 1e-5
SEQ = P(None, "seq")


@pytest.fixture(autouse=True, scope="module")
def small_blocks():  # chunks and query blocks of 4 positions: several at T = 16
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(simple, "CHUNK", 4)
    mp.setattr(decay, "CHUNK", 4)
    mp.setattr(local, "_default_block", lambda s, t_len: 4)
    mp.setattr(conv, "BAND_CHUNK", 4)
    mp.setattr(conv, "DENSE_MAX_T", 8)  # causal AFT-conv1d: T = 16 the band, its halves dense
    yield


# Every form is fn(q, k, v, w) (w: the bias [T, T] or the AFT-conv kernel, shared).


def _kernel_bias(kernel, t_len, causal):  # AFT-conv1d's kernel [H, s] as the bias [T, T, H]
  t, tp = np.arange(t_len)[:, None], np.arange(t_len)[None, :]
  s = kernel.shape[-1]
  j = t - tp if causal else tp - t + s // 2
  inside = (j >= 0) & (j < s)
  return jnp.where(inside[..., None], kernel.T[np.clip(j, 0, s - 1)], 0.0)


def _conv1d_dense(causal, packed=False):
  def dense(q, k, v, kernel):
    t_len = k.shape[-2]
    mask = key_mask(t_len, causal, packed)[..., None]
    return jax.nn.sigmoid(q) * dense_mean(k, v, _kernel_bias(kernel, t_len, causal), mask, True)

  return dense


def _decay_dense(packed):  # w [2, D]: the decay |w[0]| per position back, the bonus w[1] at 0
  def dense(q, k, v, w):
    lag = np.arange(k.shape[-2])[:, None] - np.arange(k.shape[-2])[None, :]
    bias = jnp.where((lag == 0)[..., None], w[1], -jnp.abs(w[0]) * lag[..., None])
    mask = key_mask(k.shape[-2], True, packed)[..., None]
    return jax.nn.sigmoid(q) * dense_mean(k, v, bias, mask)

  return dense


def _conv2d_dense(q, k, v, kernel):
  (ht, wd), (kh, kw) = k.shape[-3:-1], kernel.shape[1:]
  r, c = np.divmod(np.arange(ht * wd), wd)
  a = r[None, :] - r[:, None] + kh // 2  # the kernel entry of key (r', c') seen from (r, c)
  b = c[None, :] - c[:, None] + kw // 2
  inside = ((a >= 0) & (a < kh) & (b >= 0) & (b < kw))[..., None]
  bias = jnp.where(
    inside, jnp.moveaxis(kernel[:, np.clip(a, 0, kh - 1), np.clip(b, 0, kw - 1)], 0, -1), 0.0
  )
  flat = lambda x, n: x.reshape(x.shape[: x.ndim - n - 2] + (ht * wd,) + x.shape[x.ndim - n :])
  mean = dense_mean(flat(k, 1), flat(v, 2), bias, np.ones((1, 1, 1), bool), conv=True)
  return jax.nn.sigmoid(q) * mean.reshape(q.shape)


def _halves(x, axis):
  cut = x.shape[axis] // 2
  return jax.lax.slice_in_dim(x, 0, cut, axis=axis), jax.lax.slice_in_dim(x, cut, None, axis=axis)


def _forms(impl):  # name -> (fn, dense reference, NumPy reference or None, input kind)
  seg = lambda k: jnp.broadcast_to(segments(k.shape[-2])[0], k.shape[:-1])
  pos = lambda k: jnp.broadcast_to(segments(k.shape[-2])[1], k.shape[:-1])

  def two_pieces(op, offset):  # the second piece after the first's state (at its offset)
    def fn(q, k, v, w):
      t = k.ndim - 2  # T's axis in q, k and v
      (q1, q2), (k1, k2), (v1, v2) = (_halves(x, t) for x in (q, k, v))
      y1, state = op(q1, k1, v1, w, causal=True, output_final_state=True)
      at = {"offset": k1.shape[t]} if offset else {}
      return jnp.concatenate([y1, op(q2, k2, v2, w, causal=True, initial_state=state, **at)], t)

    return fn

  def packed(op, positions):
    def fn(q, k, v, w):
      ids = dict(segment_ids=seg(k), **({"positions": pos(k)} if positions else {}))
      return op(q, k, v, w, causal=True, **ids)

    return fn

  ops_ = {  # name -> (op, its window for dense_op, its NumPy reference given causal)
    "full": (functools.partial(ops.aft_full, impl=impl), None,
             lambda c: lambda q, k, v, w: ref.aft_full(q, k, v, w, c)),
    "local": (functools.partial(ops.aft_local, window=WINDOW, impl=impl), WINDOW,
              lambda c: lambda q, k, v, w: ref.aft_local(q, k, v, w, WINDOW, c)),
    "simple": (lambda q, k, v, w, **kw: ops.aft_simple(q, k, v, impl=impl, **kw), 0,
               lambda c: lambda q, k, v, w: ref.aft_simple(q, k, v, c)),
    "conv1d": (functools.partial(ops.aft_conv1d, impl=impl), "conv1d",
               lambda c: lambda q, k, v, w: ref.aft_conv1d(q, k, v, w, c)),
  }  # fmt: skip
  conv2d = functools.partial(ops.aft_conv2d, impl=impl)
  forms = {"conv2d": (conv2d, _conv2d_dense, ref.aft_conv2d, "conv2d")}
  dec = lambda q, k, v, w, **kw: ops.aft_decay(q, k, v, jnp.abs(w[0]), w[1], impl=impl, **kw)
  dec_ref = lambda q, k, v, w: ref.aft_decay(q, k, v, np.abs(w[0]), w[1])
  forms["decay-causal"] = (dec, _decay_dense(False), dec_ref, "decay")
  forms["decay-state"] = (two_pieces(dec, False), _decay_dense(False), dec_ref, "decay")
  forms["decay-packed"] = (packed(dec, False), _decay_dense(True), None, "decay")
  for n, (op, window, numpy) in ops_.items():
    kind = "conv1d" if n == "conv1d" else "seq"
    dense = lambda c, p=False: _conv1d_dense(c, p) if kind == "conv1d" else dense_op(window, c, p)
    forms[n] = (op, dense(False), numpy(False), kind)
    forms[n + "-causal"] = (functools.partial(op, causal=True), dense(True), numpy(True), kind)
    if n != "full":
      forms[n + "-state"] = (two_pieces(op, n == "local"), dense(True), numpy(True), kind)
    forms[n + "-packed"] = (packed(op, n in ("full", "local")), dense(True, True), None, kind)
  return forms


# (form, impl) -> (T, D): every form on XLA, every kernel on its plain and state forms (packed
# forms run XLA whatever the impl; axis_name: tests/support/transforms_worker.py).
CASES = {(name, "xla"): (16, 8) for name in _forms("xla")}
KERNEL_FORMS = [f"{n}-{form}" for n in ("simple", "local", "decay") for form in ("causal", "state")]
CASES.update({(n, "pallas_interpret"): (32, 16) for n in KERNEL_FORMS})
CASES[("simple-causal", "tpu_interpret")] = (32, 128)
# Forward mode (XLA): the hand-written derivatives, and AFT-conv2d (autodiff under the gate's JVP).
FORWARD = ("full", "full-causal", "local", "local-causal", "simple-causal", "conv1d-causal")
FORWARD += ("conv2d", "decay-causal")


def _inputs(kind, t_len, d, seed=0):  # (q, k, v, w), an output cotangent, input tangents
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  if kind in ("seq", "decay"):
    shapes = [(B, t_len, d)] * 3 + [(t_len, t_len) if kind == "seq" else (2, d)]
  elif kind == "conv1d":
    shapes = [(B, t_len, HEADS, CH), (B, t_len, HEADS), (B, t_len, HEADS, CH), (HEADS, KERNEL)]
  else:
    img = (B, *IMG)
    shapes = [(*img, HEADS, CH), (*img, HEADS), (*img, HEADS, CH), (HEADS, KERNEL, KERNEL)]
  x = tuple(f(*s) for s in shapes)
  return x, f(*shapes[0]), tuple(f(*s) for s in shapes)


def _grads(fn, *args):
  return jax.grad(fn, argnums=tuple(range(len(args))))(*args)


def _nest(x):  # [B, ...] -> [2, S, B / 2, ...]: two vmapped axes, the inner one after S
  return jnp.moveaxis(x.reshape((2, B // 2) + x.shape[1:]), 1, 2)


def _reverse(fn):
  """vmap of grad of a lax.scan over two layers of jax.checkpoint of fn vmapped over axis 1."""
  inner = jax.checkpoint(jax.vmap(fn, (1, 1, 1, None), 1))

  def loss(q, k, v, ws, ct):
    y = jax.lax.scan(lambda h, w: (inner(q, k, h, w), None), v, ws)[0]
    return jnp.sum(y * ct), y

  grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
  return jax.vmap(grads, (0, 0, 0, None, 0))


def _forward(fn, x, tx, ct, jacrev=True):
  """jacfwd, jacrev (w.r.t. k and w) and vmapped Hessian-vector products."""
  q, k, v, w = x
  x1 = (q[:1], k[:1], v[:1], w)
  loss = lambda *a: jnp.sum(fn(*a) * ct)
  hvp = lambda t: jax.jvp(lambda *a: _grads(loss, *a), x, t)[1]
  two = jax.tree.map(lambda t: jnp.stack([t, -0.5 * t[::-1]]), tx)
  out = {"jacfwd": jax.jacfwd(fn, argnums=(1, 3))(*x1), "hvp": jax.vmap(hvp)(two)}
  if jacrev:
    out["jacrev"] = jax.jacrev(fn, argnums=(1, 3))(*x1)
  return out


def _close(got, want, what, whole_tree=False):  # to TOL of the largest entry (of the leaf)
  top = max(float(np.max(np.abs(np.asarray(w)))) for w in jax.tree.leaves(want))
  for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
    w = np.asarray(w, np.float64)
    scale = max(top if whole_tree else float(np.max(np.abs(w))), 1e-30)
    np.testing.assert_allclose(np.asarray(g), w, rtol=TOL, atol=TOL * scale, err_msg=f"{what} {i}")


def _case_fn(name, impl):
  if impl == "tpu_interpret":
    return (lambda *a: tpu_simple(*a[:3]), *_forms("xla")[name][1:])
  return _forms(impl)[name]


def test_dense_references_are_the_float64_ones():
  done = set()
  for name, impl in CASES:
    _, _, numpy_ref, kind = _case_fn(name, impl)
    base = name.replace("-state", "-causal")
    if numpy_ref is None or (base, CASES[name, impl]) in done:
      continue
    done.add((base, CASES[name, impl]))
    dense = _forms("xla")[base][1]
    x = _inputs(kind, *CASES[name, impl])[0]
    _close(jax.jit(dense)(*x), numpy_ref(*x), f"dense reference {name} {impl}")
  assert len(done) == 14, done


@pytest.mark.parametrize("name,impl", list(CASES), ids=[f"{n}-{i}" for n, i in CASES])
def test_reverse_mode_under_vmap_checkpoint_and_scan(name, impl):
  fn, dense, _, kind = _case_fn(name, impl)
  x, ct, _ = _inputs(kind, *CASES[name, impl])

  @jax.jit
  def run(x, ct):  # (the layout of ``_reverse``'s arguments in the same program)
    args = (*map(_nest, x[:3]), jnp.stack([x[3], 0.5 * x[3]]), _nest(ct))
    return _reverse(fn)(*args), _reverse(dense)(*args)

  got, want = run(x, ct)
  (_, y), grads = got
  (_, y_want), grads_want = want
  _close(y, y_want, "values")
  _close(grads, grads_want, "gradients")


@pytest.mark.parametrize("name", FORWARD)
def test_forward_mode_on_the_xla_path(name):
  fn, dense, _, kind = _forms("xla")[name]
  x, ct, tx = _inputs(kind, 16, 8)
  # XLA:CPU (jax 0.10.2) miscompiles conv2d's jacrev (vmap of conv._prefix0's transpose at a
  # batch >= 32 reads unwritten memory): its reverse mode is test_reverse_mode's alone.
  rev = name != "conv2d"
  run = jax.jit(lambda *a: (_forward(fn, *a, rev), _forward(dense, *a, rev)))
  got, want = run(x, tx, ct)
  _close(got, want, "forward mode")
  if rev:
    _close(got["jacfwd"], got["jacrev"], "jacfwd == jacrev")


@pytest.mark.parametrize("how", ["jvp", "hvp"])  # a JVP tracer on top, or under grad's
def test_kernels_refuse_forward_mode_in_one_line(how):
  x, _, tx = _inputs("seq", 32, 16)
  fn = lambda *a: ops.aft_local(*a, window=WINDOW, causal=True, impl="pallas_interpret")
  loss = lambda *a: jnp.sum(fn(*a))
  transform = {"jvp": lambda: jax.jvp(fn, x, tx)}
  transform["hvp"] = lambda: jax.jvp(jax.grad(loss, argnums=(0, 1, 2, 3)), x, tx)
  with pytest.raises(ValueError, match="^aft_local: .*forward-mode.*use impl='xla'") as e:
    jax.eval_shape(transform[how])
  assert "\n" not in str(e.value)


def _params(module, shape):  # every parameter random (w takes part), in one program
  @jax.jit
  def make():
    variables = nn.meta.unbox(module.init(jax.random.key(0), jnp.zeros(shape)))
    leaves, tree = jax.tree.flatten(variables)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree.unflatten(
      tree, [x + 0.3 * jax.random.normal(key, x.shape) for x, key in zip(leaves, keys)]
    )

  return make()


def test_layers_per_example_gradients():
  """DP-SGD's vmap of grad: each example's grad alone, their sum grad of the summed loss."""
  shape = (B, 16, 8)
  module = layers.AFTLocal(max_len=16, window=WINDOW, hidden_dim=8, causal=True, impl="xla")
  params = _params(module, shape)
  rng = np.random.default_rng(2)
  x, ct = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(2))
  loss = lambda p, x, ct: jnp.sum(module.apply(p, x[None])[0] * ct)

  @jax.jit
  def run(params, x, ct):
    each = jax.vmap(jax.grad(loss), (None, 0, 0))(params, x, ct)
    total = jax.grad(lambda p: jnp.sum(jax.vmap(loss, (None, 0, 0))(p, x, ct)))(params)
    return each, total, jax.grad(loss)(params, x[0], ct[0])

  each, total, first = run(params, x, ct)
  _close(jax.tree.map(lambda g: g[0], each), first, "example 0", whole_tree=True)
  total_each = jax.tree.map(lambda g: jnp.sum(g, axis=0), each)
  _close(total_each, total, "sum over examples", whole_tree=True)


def test_shard_map_with_its_defaults():  # tests/support/transforms_worker.py's asserts
  cmd = [sys.executable, "-m", "tests.support.transforms_worker"]
  proc = prefork.run(cmd, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert proc.stdout.split() == ["checked", "simple", "local", "decay"], proc.stdout


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_kernels_lower_inside_shard_map(platform):
  """grad of impl="pallas" with axis_name on an abstract 4-device mesh: both kernels there."""
  kind, call, d = {"cuda": ("NVIDIA H200", "gpu", 64), "tpu": ("TPU v5 lite", "tpu", 128)}[platform]
  device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=1, platform=call)
  mesh = jax.sharding.AbstractMesh((4,), ("seq",), abstract_device=device)
  sds = lambda shape, spec: jax.ShapeDtypeStruct(
    shape, jnp.float32, sharding=NamedSharding(mesh, spec)
  )
  args = [sds((2, 256, d), SEQ)] * 3 + [sds((256, 256), P())]
  names = ["aft_simple"] + (["aft_local"] if platform == "cuda" else [])
  for name in names:
    window = {"window": 4} if name == "aft_local" else {}
    run = lambda q, k, v, w: getattr(ops, name)(
      q, k, v, *([w] if window else []), causal=True, impl="pallas", axis_name="seq", **window
    )
    f = jax.shard_map(run, mesh=mesh, in_specs=(SEQ, SEQ, SEQ, P()), out_specs=SEQ)
    grad = jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2, 3))
    with jax.sharding.use_abstract_mesh(mesh):
      exported = jax.export.export(
        jax.jit(grad),
        platforms=[platform],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(ops.KERNEL_CALLS[call])],
      )(*args)
    assert exported.mlir_module().count(ops.KERNEL_CALLS[call]) >= 2, name


def test_interpreted_kernels_are_refused_inside_shard_map_in_one_line():
  mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
  run = lambda q, k, v: ops.aft_simple(
    q, k, v, causal=True, impl="pallas_interpret", axis_name="seq"
  )
  f = jax.shard_map(run, mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)
  with pytest.raises(ValueError, match="^Pallas' interpreter cannot run inside jax.shard_map") as e:
    jax.jit(f).lower(*(jnp.ones((2, 64, 16)),) * 3)
  assert "\n" not in str(e.value)
