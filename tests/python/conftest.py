"""pytest set-up for strata's Python tests: the package from the source tree
(bindings/python), the example model (examples/python), and libstrata.so from
the build that runs the tests (STRATA_LIBRARY, set by meson)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for sub in ("bindings/python", "examples/python", "tests/python"):
    path = os.path.join(ROOT, sub)
    if path not in sys.path:
        sys.path.insert(0, path)


@pytest.fixture
def swap_dir(tmp_path):
    d = tmp_path / "swap"
    d.mkdir()
    return str(d)
