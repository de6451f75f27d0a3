"""Shared fixtures: the prepared default model (built once, offline).

Without a GPU, kvpolicy's Triton kernels run in Triton's interpreter: the flag
is read when a kernel is defined, so it is set here, before any test module
imports ``kvpolicy_triton``.
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def model_path() -> Path:
    from kvpolicy.offline.model import prepare

    return prepare()
