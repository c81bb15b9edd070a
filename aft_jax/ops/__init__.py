"""The AFT operations (Zhai et al., 2021, arXiv 2105.14103) as pure functions of arrays.

q, k, v are ``[..., T, D]`` (any leading batch dims); every op computes, per position t and
channel d, Y[t, d] = sigma(q[t, d]) * sum_t' exp(k[t', d] + w[t, t']) v[t', d] / sum_t'
exp(k[t', d] + w[t, t']), the variants differing in the bias w and in which t' are summed
(``causal=True``: t' <= t). Every sum is an exact log-sum-exp (finite and accurate in float32
for finite logits of any size); a causal op never lets a later position, not even a NaN or an
infinity, reach an earlier output or its gradient. float32 inputs multiply at HIGHEST precision;
bfloat16 inputs take bfloat16 factors, float32 accumulation, and give bfloat16 outputs. Bad
input is a one-line ValueError naming the argument, before anything is traced; an empty input
gives the empty output; an eager call is one program per shape and device.

Layout, by op (flash-linear-attention's ``fla/ops/<op>/``; docs/kernels.md): each module owns an
op's maths and all its modes: a whole sequence; a piece with a state in and out
(``initial_state``, ``output_final_state``, AFT-local's ``offset``); packed documents
(``segment_ids``, ``positions``); T sharded over a mesh axis inside ``jax.shard_map``
(``axis_name``); and the one-token decoding step with its init state.

    simple.py      aft_simple (Eq. 5, w = 0): causal sums in chunks
    local.py       aft_local (Eq. 4): the banded sums, which AFT-full shares
    full.py        aft_full (Eq. 2): AFT-local's sums with a band of every key
    conv.py        aft_conv1d, aft_conv2d (Eq. 6): a kernel per head, exact prefix scans
    logsumexp.py   the (max, num, den) triple, its combine, and the states built from it
    common.py      the checks; the implementation chosen (``resolve``) for the device the
                   program is lowered for; the kernel or XLA called; the eager program
    pallas/        the kernels: triton_simple, triton_local (GPU; shared: triton), mosaic_simple

``impl``: "xla" (the jax.numpy code); "pallas" (the op's compiled kernel: causal AFT-simple and
AFT-local on GPUs of compute capability 8.0 and up, causal AFT-simple on TPUs); "pallas_interpret"
(the GPU kernel in Pallas' interpreter, for tests); "auto" (the kernel where one takes the op,
the device and the channels, inside ``jax.lax.platform_dependent``; XLA otherwise and on TPUs,
where the kernel is opt-in). The choice changes results only by float rounding; a kernel asked
for that cannot run is a ValueError.
"""

from aft_jax.ops.common import IMPLS, KERNEL_CALLS, DeviceFacts, check_window, device_facts
from aft_jax.ops.conv import aft_conv1d, aft_conv1d_init, aft_conv1d_step, aft_conv2d
from aft_jax.ops.full import aft_full, aft_full_init, aft_full_step
from aft_jax.ops.local import aft_local, aft_local_init, aft_local_step
from aft_jax.ops.logsumexp import Acc, WindowState, same_segment, segment_positions
from aft_jax.ops.simple import aft_simple, aft_simple_init, aft_simple_step

__all__ = [
  "IMPLS",
  "KERNEL_CALLS",
  "Acc",
  "DeviceFacts",
  "WindowState",
  "aft_conv1d",
  "aft_conv1d_init",
  "aft_conv1d_step",
  "aft_conv2d",
  "aft_full",
  "aft_full_init",
  "aft_full_step",
  "aft_local",
  "aft_local_init",
  "aft_local_step",
  "aft_simple",
  "aft_simple_init",
  "aft_simple_step",
  "check_window",
  "device_facts",
  "same_segment",
  "segment_positions",
]
