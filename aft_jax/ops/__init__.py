"""The AFT operations (Zhai et al., 2021, arXiv 2105.14103) as pure functions of q, k, v
``[..., T, D]``, differing in the bias w (docs/kernels.md; their modes: docs/long_sequences.md)."""

from aft_jax.ops.common import IMPLS, KERNEL_CALLS, DeviceFacts, check_window, device_facts
from aft_jax.ops.conv import aft_conv1d, aft_conv1d_init, aft_conv1d_step, aft_conv2d
from aft_jax.ops.decay import aft_decay, aft_decay_init, aft_decay_step
from aft_jax.ops.local import aft_full, aft_full_init, aft_full_step, aft_local, aft_local_init
from aft_jax.ops.local import aft_local_step
from aft_jax.ops.logsumexp import Acc, WindowState, same_segment, segment_positions
from aft_jax.ops.simple import aft_simple, aft_simple_init, aft_simple_step

__all__ = [
  "IMPLS", "KERNEL_CALLS", "Acc", "DeviceFacts", "WindowState", "aft_conv1d", "aft_conv1d_init",
  "aft_conv1d_step", "aft_conv2d", "aft_decay", "aft_decay_init", "aft_decay_step", "aft_full",
  "aft_full_init", "aft_full_step", "aft_local", "aft_local_init", "aft_local_step", "aft_simple",
  "aft_simple_init", "aft_simple_step", "check_window", "device_facts", "same_segment",
  "segment_positions",
]  # fmt: skip
