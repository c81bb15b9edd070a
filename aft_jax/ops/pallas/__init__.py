"""The Pallas kernels of the ops, apart from their XLA maths: ``triton_simple`` and
``triton_local`` (GPU, Triton lowering; what they share, the launch plan and the chunk-parallel
form: ``triton``) and ``mosaic_simple`` (TPU, Mosaic lowering). Each kernel module ends in its
``mean(k, v, w, window, interpret)`` and ``unsupported(channels, window)``, the entries of the
op's ``common.Kernel``."""
