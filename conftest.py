"""Root conftest: one GPU per pytest-xdist worker, Triton's interpreter where there is no GPU, the suite's plugin."""

import os

from suite.sharding import pin_worker_to_gpu

pin_worker_to_gpu()  # before anything initialises CUDA in this process

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton reads this when a kernel is decorated: set it before any kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["suite.plugin"]
