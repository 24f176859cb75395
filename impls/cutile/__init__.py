"""Our cuTile FMHA kernels (``kernel.py``, ``decode.py``): the NVIDIA blog's optimisation ladder and the autotuned
kernels.

- ``cutile-1-baseline`` ... ``cutile-5-remap``: the blog's steps, each a :class:`~impls.cutile.config.Variant` of one
  kernel (``dense.py``);
- ``cutile``: every optimisation on, tile shape and occupancy chosen from a per-architecture search space
  (``spaces.py``) by the tuner (``tuner.py``), once per shape class, cached on disk and in the process; and its
  serving operations, paged decode and varlen prefill (``serving.py``), MLA decode (``mla_serving.py``) and mixed
  prefill and decode (``mixed_serving.py``);
- ``cutile`` for op="backward": the FlashAttention-2 backward (``backward_kernels.py``, registered in ``backward.py``).

A variant's hints (occupancy, num_ctas) are applied by ``Variant.kernel()``, the one object both the launch
(``launch.py``) and the cubin export (``export.py``) use.
"""

from impls.cutile import backward, dense, mixed_serving, mla_serving, serving  # noqa: F401 - registers every entry
