"""The transformers version range (run/transformers_compat.py): a version outside it is refused before anything is
built, with an error that names the version and the fix."""

from __future__ import annotations

import pytest
import transformers

import moe_offload as mo
from moe_offload.run import transformers_compat as compat
from moe_offload.run.transformers_compat import SUPPORTED, check_version
from moe_offload.tiny.make import make_tiny


@pytest.mark.parametrize("version", ["5.0.0", "5.24.0", "5.99.1.dev0"])
def test_versions_in_the_range_pass(version):
    check_version(version)


@pytest.mark.parametrize("version", ["4.57.1", "6.0.0", "nightly"])
def test_a_version_outside_the_range_is_refused_naming_it_and_the_fix(version):
    with pytest.raises(mo.ConfigError) as err:
        check_version(version)
    assert version in str(err.value) and f"transformers>={SUPPORTED[0]},<{SUPPORTED[1]}" in str(err.value)


def test_the_installed_transformers_is_in_the_range():
    check_version()
    assert compat.installed() == transformers.__version__
    assert SUPPORTED[0] <= int(transformers.__version__.split(".")[0]) < SUPPORTED[1]


def test_load_refuses_an_unsupported_transformers_before_building_anything(tmp_path, monkeypatch):
    folder = make_tiny(tmp_path / "m", family="qwen3_moe", layers=1, experts=4, top_k=2, hidden=32)
    monkeypatch.setattr(compat, "installed", lambda: "4.57.1")
    with pytest.raises(mo.ConfigError, match="transformers 4.57.1 is installed"):
        mo.load(folder, offload_gb=0)
