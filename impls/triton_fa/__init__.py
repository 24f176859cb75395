"""Our Triton kernels: FlashAttention-2 forward (``kernel.py``) registered as ``triton`` and ``triton-tma`` with its
varlen entry (``dense.py``), the split-KV paged decode (``decode.py``) as ``triton``'s paged entry
(``paged.py``), and the FlashAttention-2 backward (``backward.py``) as ``triton``'s backward entry; what they
share is in ``config.py``, ahead-of-time compilation for CI in ``aot.py``.
"""

from impls.triton_fa import backward, dense, paged  # noqa: F401 - registers the dense, varlen, paged and backward entries
