"""Every test here keeps the measurement cache (pipetrain.profile.cache) in its own temporary
directory, never the user's ``~/.cache/pipetrain``."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipetrain.profile.cache import CACHE_ENV


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "measurement-cache"
    monkeypatch.setenv(CACHE_ENV, str(path))
    return path
