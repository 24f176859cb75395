"""Our Triton kernels: FlashAttention-2 forward (``kernel.py``) registered as ``triton`` and ``triton-tma`` with its
varlen entry (``dense.py``), the split-KV paged decode (``decode.py``) as ``triton``'s paged entry
(``paged.py``), the split-KV MLA decode as its mla entry (``mla.py``), the one-launch mixed prefill and decode as its
mixed entry (``mixed.py``) and the FlashAttention-2 backward
(``backward.py``) as its backward entry; what they share is in ``config.py``, ahead-of-time compilation for CI in
``aot.py``.
"""

from impls.triton_fa import backward, dense, mixed, mla, paged  # noqa: F401 - registers every entry of the family
