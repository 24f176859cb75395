"""Flash-attention forward implementations behind one contract (see ``impls._registry``).

Each module of this package registers its implementations with ``@register``; ``load_all()`` imports
them all. A module must import cleanly without its optional packages: it imports them lazily and
declares them through ``requires=`` so that a missing package becomes a reason, not a crash.
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
from impls._validate import default_scale, validate_attention_inputs

__all__ = [
    "FLOATS",
    "HALF",
    "REGISTRY",
    "Impl",
    "Prepared",
    "Unsupported",
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
