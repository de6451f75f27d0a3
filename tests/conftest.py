"""Shared fixtures: the prepared default model (built once, offline)."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_path() -> Path:
    from kvpolicy.model import prepare

    return prepare()
