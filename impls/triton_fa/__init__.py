"""Our Triton kernels: FlashAttention-2 forward (``kernel.py``) registered as ``triton`` and ``triton-tma`` with its
varlen entry (``dense.py``), the split-KV paged decode (``decode.py``) as ``triton``'s paged entry (``paged.py``),
and the split-KV MLA decode as its mla entry (``mla.py``); what they share is in ``config.py``, ahead-of-time
compilation for CI in ``aot.py``.
"""

from impls.triton_fa import dense, mla, paged  # noqa: F401 - registers the dense, varlen, paged and MLA decode entries
