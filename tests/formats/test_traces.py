"""Routing traces: the file format of docs/cli.md, written and read back, and every rule of it checked with its line."""

from __future__ import annotations

import json
import os

import pytest

from moe_offload.errors import TraceError
from moe_offload.formats.traces import (Trace, TraceHeader, TraceRow, TraceWriter, check_trace_matches, expert_counts,
                                read_trace, routing_array, skew_summary, write_trace)

HEADER = TraceHeader("mixtral", 8, 2, (0, 1, 3), "hand-made")
ROWS = (
    TraceRow(0, 0, "prefill", ((6, 5), (3, 1), (0, 7))),
    TraceRow(0, 1, "decode", ((1, 5), (3, 2), (0,))),      # layer 3 dropped one pick
    TraceRow(1, 0, "prefill", ((2, 4), (4, 0), (7, 6))),
    TraceRow(1, 1, "decode", ((5, 1), (2, 3), (7, 0))),
)
GOOD_HEADER = {"format": "moe-offload-trace", "version": 1, "model_type": "mixtral", "num_experts": 8, "top_k": 2,
               "layers": [0, 1, 3]}
GOOD_ROW = {"seq": 0, "pos": 0, "phase": "decode", "experts": [[1, 2], [3], [4, 5]]}


def write_lines(tmp_path, *objs, raw: str | None = None):
    path = tmp_path / "trace.jsonl"
    path.write_text(raw if raw is not None else "".join(json.dumps(o) + "\n" for o in objs))
    return path


def test_round_trip(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, HEADER, ROWS)
    trace = read_trace(path)
    assert trace.header == HEADER and trace.rows == ROWS and trace.path == str(path)
    assert trace.decode_rows == (ROWS[1], ROWS[3])
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {**GOOD_HEADER, "source": "hand-made"}
    assert json.loads(lines[2]) == {"seq": 0, "pos": 1, "phase": "decode", "experts": [[1, 5], [3, 2], [0]]}
    assert len(lines) == 5 and not list(tmp_path.glob(".*tmp*"))


def test_reader_ignores_unknown_keys_and_takes_a_header_without_source(tmp_path):
    trace = read_trace(write_lines(tmp_path, {**GOOD_HEADER, "tool": "x"}, {**GOOD_ROW, "weights": [[0.6, 0.4]]}))
    assert trace.header.source == "" and trace.rows[0].experts == ((1, 2), (3,), (4, 5))


def test_writer_streams_and_appears_only_on_close(tmp_path):
    path = tmp_path / "t.jsonl"
    writer = TraceWriter(path, HEADER)
    writer.add(ROWS[0])
    assert not path.exists()           # nothing half-written in place
    writer.add(ROWS[1])
    writer.close()
    assert read_trace(path).rows == ROWS[:2] and writer.rows == 2


def test_writer_leaves_nothing_on_error_and_keeps_an_old_file(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("old\n")
    with pytest.raises(RuntimeError):
        with TraceWriter(path, HEADER) as w:
            w.add(ROWS[0])
            raise RuntimeError("the model failed mid-profile")
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["t.jsonl"]


def test_writer_refuses_rows_the_reader_would_refuse(tmp_path):
    with TraceWriter(tmp_path / "t.jsonl", HEADER) as w:
        with pytest.raises(TraceError, match=r"trace row 1: layer 1: expert id 8 is outside 0\.\.7"):
            w.add(TraceRow(0, 0, "decode", ((1,), (8,), (2,))))
        with pytest.raises(TraceError, match="experts has 2 lists but the header names 3 layers"):
            w.add(TraceRow(0, 0, "decode", ((1,), (2,))))
    with pytest.raises(TraceError, match="top_k 9 is not an integer from 1 to num_experts"):
        TraceWriter(tmp_path / "u.jsonl", TraceHeader("mixtral", 8, 9, (0,)))
    with pytest.raises(TraceError, match="cannot write trace"):
        write_trace(tmp_path / "missing" / "t.jsonl", HEADER, ROWS)


BAD_HEADERS = [
    ({**GOOD_HEADER, "format": "other"}, "format 'other' is not 'moe-offload-trace'"),
    ({k: v for k, v in GOOD_HEADER.items() if k != "format"}, "format None is not"),
    ({**GOOD_HEADER, "version": 2}, "trace version 2, this moe-offload reads version 1"),
    ({**GOOD_HEADER, "model_type": 3}, "model_type 3 is not a string"),
    ({**GOOD_HEADER, "num_experts": 0}, "num_experts 0 is not a positive integer"),
    ({**GOOD_HEADER, "num_experts": 8.0}, "num_experts 8.0 is not a positive integer"),
    ({**GOOD_HEADER, "top_k": 0}, "top_k 0 is not an integer from 1 to num_experts"),
    ({**GOOD_HEADER, "top_k": True}, "top_k True is not an integer"),
    ({**GOOD_HEADER, "layers": []}, r"layers \[\] is not a non-empty list"),
    ({**GOOD_HEADER, "layers": [0, -1]}, "is not a non-empty list of layer indices"),
    ({**GOOD_HEADER, "layers": [1, 0, 3]}, "are not distinct and ascending"),
    ({**GOOD_HEADER, "layers": [0, 0, 3]}, "are not distinct and ascending"),
    ({**GOOD_HEADER, "source": 1}, "source 1 is not a string"),
    ([1, 2], "the header is not a JSON object"),
]


@pytest.mark.parametrize("header,message", BAD_HEADERS)
def test_bad_header_is_named_on_line_1(tmp_path, header, message):
    path = write_lines(tmp_path, header, GOOD_ROW)
    with pytest.raises(TraceError, match=rf"^{path}:1: .*{message}"):
        read_trace(path)


BAD_ROWS = [
    ({**GOOD_ROW, "seq": -1}, "seq -1 is not an integer >= 0"),
    ({**GOOD_ROW, "seq": "0"}, "seq '0' is not an integer"),
    ({k: v for k, v in GOOD_ROW.items() if k != "pos"}, "pos None is not an integer"),
    ({**GOOD_ROW, "phase": "generate"}, "phase 'generate' is neither 'prefill' nor 'decode'"),
    ({**GOOD_ROW, "experts": [[1, 2], [3]]}, "experts has 2 lists but the header names 3 layers"),
    ({**GOOD_ROW, "experts": {"0": [1]}}, "experts has no lists but the header names 3 layers"),
    ({**GOOD_ROW, "experts": [[1, 2], [8], [4]]}, r"layer 1: expert id 8 is outside 0\.\.7 \(num_experts 8\)"),
    ({**GOOD_ROW, "experts": [[1, 2], [3], [-1]]}, "layer 3: expert id -1 is outside"),
    ({**GOOD_ROW, "experts": [[1, 2, 3], [3], [4]]}, "layer 0: 3 experts picked but top_k is 2"),
    ({**GOOD_ROW, "experts": [[1, 1], [3], [4]]}, r"layer 0: expert ids \[1, 1\] repeat"),
    ({**GOOD_ROW, "experts": [[1, 2.0], [3], [4]]}, "layer 0: .* is not a list of integer expert ids"),
    ({**GOOD_ROW, "experts": [[1, 2], 3, [4]]}, "layer 1: 3 is not a list of integer expert ids"),
    ([0, 0, "decode"], "a token row must be a JSON object"),
]


@pytest.mark.parametrize("row,message", BAD_ROWS)
def test_bad_row_is_named_with_its_line(tmp_path, row, message):
    path = write_lines(tmp_path, GOOD_HEADER, GOOD_ROW, GOOD_ROW, row)   # the bad row is line 4
    with pytest.raises(TraceError, match=rf"^{path}:4: .*{message}"):
        read_trace(path)


@pytest.mark.parametrize("raw,line,message", [
    ("", 1, "the file is empty"),
    (json.dumps(GOOD_HEADER) + "\n{\"seq\": 0,\n", 2, "not JSON"),
    (json.dumps(GOOD_HEADER) + "\n\n" + json.dumps(GOOD_ROW) + "\n", 2, "empty line"),
    ("not json\n", 1, "not JSON"),
])
def test_broken_lines(tmp_path, raw, line, message):
    path = write_lines(tmp_path, raw=raw)
    with pytest.raises(TraceError, match=rf"^{path}:{line}: {message}"):
        read_trace(path)


def test_missing_and_binary_files(tmp_path):
    with pytest.raises(TraceError, match="cannot read trace .*nope.jsonl: No such file"):
        read_trace(tmp_path / "nope.jsonl")
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TraceError, match="not UTF-8 text"):
        read_trace(path)


def test_a_header_alone_is_an_empty_trace(tmp_path):
    trace = read_trace(write_lines(tmp_path, GOOD_HEADER))
    assert trace.rows == () and trace.decode_rows == ()


def test_check_trace_matches_names_the_mismatch():
    trace = Trace(HEADER, ROWS, "t.jsonl")
    check_trace_matches(trace, num_experts=8, layers=[0, 1, 3], where="the model")
    with pytest.raises(TraceError, match="t.jsonl records 8 experts per layer but the model m has 16"):
        check_trace_matches(trace, num_experts=16, layers=[0, 1, 3], where="the model m")
    with pytest.raises(TraceError, match=r"routed layers \[0, 1, 3\] but the model routes layers \[0, 1, 2, 3\] "
                                         r"\(missing \[2\]\)"):
        check_trace_matches(trace, num_experts=8, layers=[0, 1, 2, 3], where="the model")
    with pytest.raises(TraceError, match=r"not routed in the model \[3\]"):
        check_trace_matches(trace, num_experts=8, layers=[0, 1], where="the model")


def test_expert_counts_by_phase_and_over_traces():
    trace = Trace(HEADER, ROWS)
    # decode rows: layer 0 picks {1,5} and {5,1}; layer 1 {3,2}, {2,3}; layer 3 {0}, {7,0}
    assert expert_counts(trace) == {0: [0, 2, 0, 0, 0, 2, 0, 0], 1: [0, 0, 2, 2, 0, 0, 0, 0],
                                    3: [2, 0, 0, 0, 0, 0, 0, 1]}
    assert expert_counts(trace, "prefill")[0] == [0, 0, 1, 0, 1, 1, 1, 0]
    assert expert_counts(trace, None)[3] == [3, 0, 0, 0, 0, 0, 1, 3]   # (0,7) (0) (7,6) (7,0)
    assert expert_counts([trace, trace])[3] == [4, 0, 0, 0, 0, 0, 0, 2]
    other = Trace(TraceHeader("mixtral", 8, 2, (0, 1)), ())
    with pytest.raises(TraceError, match="traces of different models"):
        expert_counts([trace, other])


def test_routing_array_pads_with_minus_one():
    arr = routing_array(Trace(HEADER, ROWS).decode_rows, 2, 3)
    assert arr.shape == (2, 3, 2)
    assert arr[0].tolist() == [[1, 5], [3, 2], [0, -1]]


def test_skew_summary_on_uniform_and_concentrated_layers():
    # 10 experts; layer 0: every token picks {0, 1} (concentrated); layer 1: 5 tokens cover all 10 once.
    header = TraceHeader("qwen3_moe", 10, 2, (0, 1))
    rows = tuple(TraceRow(0, i, "decode", ((0, 1), (2 * i, 2 * i + 1))) for i in range(5))
    hot, flat = skew_summary(Trace(header, rows))
    assert hot == {"layer": 0, "tokens": 5, "top10_share": 0.5, "effective_experts": pytest.approx(2.0),
                   "max_over_mean": 5.0, "unused": 8}
    assert flat == {"layer": 1, "tokens": 5, "top10_share": 0.1, "effective_experts": pytest.approx(10.0),
                    "max_over_mean": 1.0, "unused": 0}
    empty = skew_summary(Trace(header, ()))
    assert empty[0]["tokens"] == 0 and empty[0]["top10_share"] == 0.0
