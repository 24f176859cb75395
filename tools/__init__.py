"""Tools for kernel work: probes, sweeps, SASS comparisons and result helpers (``python -m tools.NAME --help``).

Run them from the repository root (``python -m tools.sweep``), or as files once the project is installed or on
``PYTHONPATH``. Each imports the GPU libraries only after parsing its options, so ``--help`` works anywhere.
"""
