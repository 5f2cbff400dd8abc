"""graph_edge.GraphEdges: a runtime's streamed experts steps as one custom operator (the compiled decode step's
opaque nodes; tests/run/test_compiled.py runs it compiled end to end)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from moe_offload.run import graph_edge
from moe_offload.run.graph_edge import GraphEdges


def _inputs():
    return torch.randn(3, 8), torch.tensor([[0, 2], [1, 2], [3, 0]]), torch.rand(3, 2)


def test_the_operator_runs_the_streamed_step_of_the_module_it_names(monkeypatch):
    calls = []
    monkeypatch.setattr(graph_edge, "streamed_step",
                        lambda state, mod, h, idx, w: (calls.append((state, mod, idx.tolist())), h * 2 + w.sum())[1])
    edges = GraphEdges()
    first, second = edges.add("state0", "module0"), edges.add("state1", "module1")
    assert (first, second) == (0, 1)
    h, idx, w = _inputs()
    out = edges.experts(1, h, idx, w)
    assert torch.equal(out, h * 2 + w.sum())
    assert calls == [("state1", "module1", idx.tolist())]
    edges.close()


def test_traced_the_operator_gives_the_hidden_states_shape_and_dtype():
    edges = GraphEdges()
    edges.add("state", "module")
    with FakeTensorMode() as mode:
        h = mode.from_tensor(torch.randn(5, 16, dtype=torch.bfloat16))
        idx = mode.from_tensor(torch.zeros(5, 4, dtype=torch.long))
        w = mode.from_tensor(torch.rand(5, 4))
        out = edges.experts(0, h, idx, w)
    assert out.shape == (5, 16) and out.dtype == torch.bfloat16
    edges.close()


def test_each_registry_has_its_own_namespace_and_close_removes_its_operator():
    a, b = GraphEdges(), GraphEdges()
    assert a.namespace != b.namespace
    ns = a.namespace
    assert hasattr(getattr(torch.ops, ns), "experts")
    a.close()
    with pytest.raises((AttributeError, RuntimeError)):
        getattr(torch.ops, ns).experts.default(*_inputs(), 0)
    b.close()


def test_a_registry_dropped_without_close_is_freed():
    edges = GraphEdges()
    edges.add("state", "module")
    ref = weakref.ref(edges)
    del edges
    gc.collect()
    assert ref() is None, "the dispatcher's implementation kept the runtime's modules alive"
