"""Test-suite set-up: the test folders mirror the packages; helper modules live in ``harness/``.

Worker processes import model and data factories from test modules by name
(``--model test_tied:tied_lm``), so every test folder is on ``sys.path`` here and on
``PYTHONPATH`` for the processes the tests start. Profiles and calibrations are cached in a
folder of this test session (``PIPETRAIN_CACHE``), never in the user's home.
"""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent
_FOLDERS = [TESTS / "harness"] + sorted(p for p in TESTS.iterdir()
                                        if p.is_dir() and p.name not in ("harness", "golden", "__pycache__"))
for _d in reversed(_FOLDERS):
    if str(_d) not in sys.path:
        sys.path.insert(0, str(_d))
os.environ["PYTHONPATH"] = os.pathsep.join([str(d) for d in _FOLDERS]
                                           + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

if "PIPETRAIN_CACHE" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="pipetrain-test-cache-")
    os.environ["PIPETRAIN_CACHE"] = _CACHE
    atexit.register(shutil.rmtree, _CACHE, True)
