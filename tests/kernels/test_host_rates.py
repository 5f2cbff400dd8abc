"""The host's rates for the cost model (kernels/host_rates.py): measured once per machine and thread count, cached,
measured again on request; a damaged cache file is measured over, never trusted."""

from __future__ import annotations

import json

import pytest
import torch

from moe_offload.kernels import host_rates


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "rates" / "host-rates.json"
    monkeypatch.setenv("MOE_OFFLOAD_HOST_RATES", str(path))
    monkeypatch.setattr(host_rates, "READ_BYTES", 16 << 20)     # a small read: this test checks the caching
    return path


def test_measured_once_then_read_from_the_cache(cache):
    said = []
    first = host_rates.measure(progress=said.append)
    assert first.measured and first.bytes_per_s > 1e8 and first.flops_per_s > 1e8 and len(said) == 1
    assert json.loads(cache.read_text())[first.key] == {"bytes_per_s": first.bytes_per_s,
                                                         "flops_per_s": first.flops_per_s}
    again = host_rates.measure(progress=said.append)
    assert not again.measured and (again.bytes_per_s, again.flops_per_s) == (first.bytes_per_s, first.flops_per_s)
    assert len(said) == 1                                         # nothing measured, nothing said
    fresh = host_rates.measure(again=True)
    assert fresh.measured


def test_the_key_names_the_thread_count(cache):
    threads = torch.get_num_threads()
    assert f"{threads} threads" in host_rates.machine_key()


def test_a_damaged_cache_is_measured_over(cache):
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    assert host_rates.measure().measured
    assert host_rates.machine_key() in json.loads(cache.read_text())


def test_no_link_on_a_cpu():
    assert host_rates.link_bytes_per_s(torch.device("cpu")) is None
