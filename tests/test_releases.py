"""The Transformers releases the package supports: what pyproject allows, refused at import otherwise, and the one
module that knows their differences."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from hf_specdec.core import releases

ROOT = Path(__file__).resolve().parents[1]


def test_supported_releases_are_pyprojects():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (requirement,) = [d for d in dependencies if d.startswith("transformers")]
    assert requirement == f"transformers{releases.RANGE}"


@pytest.mark.parametrize("version", ["5.22.2", "6.0.0", "6.0.0.dev0"])
def test_another_release_is_refused_at_import_in_one_line(version):
    code = f"import transformers; transformers.__version__ = {version!r}; import hf_specdec"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: hf_specdec supports Transformers")
    assert f"Transformers {version} is installed" in last and "pip install 'transformers>=5.23,<6'" in last


def test_a_development_release_inside_the_range_runs():
    code = "import transformers; transformers.__version__ = '5.26.0.dev0'; import hf_specdec; print('ok')"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok")


def test_nothing_else_in_the_package_asks_which_release_it_runs_on():
    """Version checks and the cache's names live in core/releases.py only (a plan file may record the version)."""
    asking = re.compile(r"past_key_values|cache_params|_is_stateful|Version\(transformers"
                        r"|transformers\.__version__ *[<>=!]")
    found = [str(path.relative_to(ROOT)) for path in (ROOT / "hf_specdec").rglob("*.py")
             if path.name != "releases.py" and asking.search(path.read_text())]
    assert found == []
