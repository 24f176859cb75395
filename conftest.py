"""Root conftest: the suite's pytest plugin, and Triton's interpreter where there is no GPU."""

import os

import torch

if not torch.cuda.is_available():
    # Triton reads this when a kernel is decorated: set it before any kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["suite.plugin"]
