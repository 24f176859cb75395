"""Flash-attention forward implementations behind one contract (``impls.contract``) and one registry.

Each module of this package registers its implementations with ``@register``; ``load_all()`` imports
them all. A module must import cleanly without its optional packages: it imports them lazily and
declares them through ``requires=`` so that a missing package becomes a reason, not a crash.

Public modules: ``impls.contract`` (inputs, validation, shape rules), ``impls.reference`` (the float64 oracle),
``impls.timing`` (measuring on the GPU's timeline), ``impls.tuning`` (the tuning cache and candidate ranking).
"""

from impls._registry import (
    FLOATS,
    HALF,
    REGISTRY,
    Impl,
    Prepared,
    Unsupported,
    get,
    load_all,
    module_available,
    probe,
    register,
    select,
    unregister,
)
from impls.contract import NO_WINDOW, MixedBatch, MLADecode, PagedKV, Varlen, default_scale, validate_attention_inputs

__all__ = [
    "FLOATS",
    "HALF",
    "NO_WINDOW",
    "REGISTRY",
    "Impl",
    "MLADecode",
    "MixedBatch",
    "PagedKV",
    "Prepared",
    "Unsupported",
    "Varlen",
    "default_scale",
    "get",
    "load_all",
    "module_available",
    "probe",
    "register",
    "select",
    "unregister",
    "validate_attention_inputs",
]
