"""`moe-offload serve` as a user runs it: a child process on a free port, driven over HTTP (the contract in
docs/cli.md, `serve`).

One tiny Qwen3-MoE (2 layers, 8 experts, top-k 2) is made per module. Two servers start together and serve most
checks (`plain`: the defaults; `keyed`: --api-key and --served-model-name); the SIGTERM check starts its own,
since it ends it. The refusals run against a copy of the model whose weights file is garbage: a refusal that
names the option (or the busy port) rather than the corrupt weights was made before any weight was read, and
a control run with valid options shows that the corrupt file is indeed reported once loading starts. The
option refusals and the `generate` reference go through main() in this process (the console script's own
code; each interpreter of its own costs seconds of start-up on a small machine); the busy port is a second
process. Every child is stopped in a finalizer, whatever the test did.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fixtures_cli import run_cli
from moe_offload.cli.main import main
from moe_offload.tiny.make import make_tiny

OFFLOAD = ("--offload-gb", "0.001")       # 1 MiB of the ~1.5 MiB model: experts and embedding offloaded
READY_S = 180.0                           # a loaded 2-core machine can take long to import torch
API_KEY = "sk-test-key"
SERVED_NAME = "tiny-served"
SHUTDOWN_S = 0.5                          # --shutdown-timeout of the SIGTERM server: a 300-token stream outlasts it
EXIT_MARGIN_S = 30.0                      # after the shutdown timeout: engine stop, interpreter exit, a busy machine


def _env() -> dict:
    """The child's environment: offline, one torch thread (as the suite's own torch), this checkout importable."""
    src = str(Path(__file__).resolve().parents[2] / "src")
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": path}


def _cli(*argv) -> list[str]:
    return [sys.executable, "-m", "moe_offload.cli.main", *map(str, argv)]


def free_port() -> int:
    """A port nothing listens on now (the OS's pick for port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def http_call(port: int, method: str, path: str, body: dict | None = None, headers: dict | None = None,
              timeout: float = 60) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=hdrs)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


class ServeProcess:
    """One `serve` child. Its stdout and stderr go to files, so a chatty child never blocks on a full pipe."""

    def __init__(self, folder: Path, logs: Path, *extra):
        self.port = free_port()
        self.err_path = logs / f"serve-{self.port}.err"
        self._out = open(logs / f"serve-{self.port}.out", "wb")
        self._err = open(self.err_path, "wb")
        self.proc = subprocess.Popen(_cli("serve", folder, *OFFLOAD, "--port", self.port, *extra), env=_env(),
                                     stdin=subprocess.DEVNULL, stdout=self._out, stderr=self._err)

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = READY_S) -> None:
        """Until stderr says "serving" and GET /health answers 200; a child that dies first fails the test."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"serve exited {self.proc.returncode} before serving:\n{self.stderr}")
            if "serving" in self.stderr:
                try:
                    if http_call(self.port, "GET", "/health", timeout=5)[0] == 200:
                        return
                except OSError:
                    pass
            time.sleep(0.1)
        pytest.fail(f"serve did not answer /health within {timeout:.0f} s:\n{self.stderr}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers: no child outlives its test."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=EXIT_MARGIN_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()
        self._err.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("serve") / "tiny-qwen", family="qwen3_moe", layers=2, experts=8,
                     top_k=2)


@pytest.fixture(scope="module")
def context(model_dir) -> int:
    return json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]


@pytest.fixture(scope="module")
def broken_dir(model_dir, tmp_path_factory) -> Path:
    """The model with a garbage weights file: loading it fails, so whatever is refused before loading says so."""
    folder = tmp_path_factory.mktemp("broken") / "tiny-qwen"
    shutil.copytree(model_dir, folder)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    return folder


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    """The plain and the keyed server, started together (their loading overlaps), stopped at the module's end."""
    logs = tmp_path_factory.mktemp("logs")
    started: dict[str, ServeProcess] = {}
    try:
        started["plain"] = ServeProcess(model_dir, logs)
        started["keyed"] = ServeProcess(model_dir, logs, "--api-key", API_KEY, "--served-model-name", SERVED_NAME)
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def plain(servers) -> ServeProcess:
    return servers["plain"]


@pytest.fixture(scope="module")
def keyed(servers) -> ServeProcess:
    return servers["keyed"]


def test_health_answers_once_serving_says_so(plain):
    status, body = http_call(plain.port, "GET", "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    assert f"serving 'tiny-qwen' on http://127.0.0.1:{plain.port}/v1" in plain.stderr


# --- refusals: exit 2, one `error:` line, nothing loaded --------------------------------------------------

LOAD_ERROR = "model.safetensors: not a readable safetensors file"   # what loading the broken copy says

# (case id, argv after `serve FOLDER --offload-gb 0.001 --port FREE`, what the error line must name). FOLDER
# is the broken copy unless the case says otherwise; {ctx} is the model's context + 1, {missing} a file that
# does not exist.
REFUSALS = [
    ("max-concurrency", ["--max-concurrency", "0"], "--max-concurrency 0"),
    ("max-queue", ["--max-queue", "-1"], "--max-queue -1"),
    ("max-model-len", ["--max-model-len", "{ctx}"], "--max-model-len {ctx}"),
    ("chat-template", ["--chat-template", "{missing}"], "--chat-template {missing}"),
    ("compile", ["--compile"], "--compile"),
    ("threads", ["--threads", "0"], "--threads 0"),
    ("no-config", [], "no config.json"),
]


def _assert_one_error_line(rc: int, out: str, err: str, message: str) -> None:
    assert rc == 2, err
    assert out == "", "nothing may be printed on stdout (the plan summary comes only after loading)"
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


@pytest.mark.parametrize("case, argv, message", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_option_error_exits_2_with_one_error_line_before_loading(capsys, broken_dir, context, tmp_path, case,
                                                                 argv, message):
    # In this process (main() is what the console script runs): each refusal comes before the server would
    # start, and the broken weights could not serve anyway, so a check that failed to refuse cannot hang here.
    folder = broken_dir
    if case == "no-config":
        folder = tmp_path / "tiny-qwen"
        shutil.copytree(broken_dir, folder)
        (folder / "config.json").unlink()
    subs = {"ctx": str(context + 1), "missing": str(tmp_path / "missing.jinja")}
    rc, out, err = run_cli(capsys, "serve", folder, *OFFLOAD, "--port", free_port(), *(a.format(**subs) for a in argv))
    _assert_one_error_line(rc, out, err, message.format(**subs))
    # The weights are garbage: a refusal that names the option, not the weights file, came before reading them.
    assert LOAD_ERROR not in err


def test_the_refusals_are_before_loading_because_loading_would_fail(capsys, broken_dir):
    """The control for the refusals: valid options on the broken copy get as far as reading the weights."""
    rc, out, err = run_cli(capsys, "serve", broken_dir, *OFFLOAD, "--port", free_port())
    _assert_one_error_line(rc, out, err, LOAD_ERROR)


def test_second_serve_on_the_same_port_exits_2_quickly_and_the_first_keeps_serving(plain, broken_dir):
    """A second process on the plain server's port: refused, naming the port, before the (broken) weights."""
    start = time.monotonic()
    done = subprocess.run(_cli("serve", broken_dir, *OFFLOAD, "--port", plain.port), env=_env(), text=True,
                          capture_output=True, timeout=READY_S)
    seconds = time.monotonic() - start
    _assert_one_error_line(done.returncode, done.stdout, done.stderr, f"port {plain.port} on 127.0.0.1 is in use")
    assert LOAD_ERROR not in done.stderr
    # An interpreter's start and imports only (a loaded 2-core machine takes a few seconds for those).
    assert seconds < 60, seconds
    assert plain.proc.poll() is None and http_call(plain.port, "GET", "/health")[0] == 200


# --- options that shape what clients see -----------------------------------------------------------------


def test_api_key_is_required_on_v1_only(keyed):
    body = {"model": SERVED_NAME, "prompt": "The river", "max_tokens": 2, "temperature": 0}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        status, raw = http_call(keyed.port, "GET", "/v1/models", headers=headers)
        assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"
        assert http_call(keyed.port, "POST", "/v1/completions", body, headers=headers)[0] == 401
    good = {"Authorization": f"Bearer {API_KEY}"}
    assert http_call(keyed.port, "GET", "/v1/models", headers=good)[0] == 200
    status, raw = http_call(keyed.port, "POST", "/v1/completions", body, headers=good)
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] >= 1
    assert http_call(keyed.port, "GET", "/health")[0] == 200   # the probe needs no key


def test_served_model_name_is_listed_and_defaults_to_the_folder_name(plain, keyed):
    status, raw = http_call(keyed.port, "GET", "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert status == 200 and [m["id"] for m in json.loads(raw)["data"]] == [SERVED_NAME]
    status, raw = http_call(plain.port, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(raw)["data"]] == ["tiny-qwen"]
    # The folder's name is not the served name where another was given.
    status, raw = http_call(keyed.port, "POST", "/v1/completions", {"model": "tiny-qwen", "prompt": "x"},
                            headers={"Authorization": f"Bearer {API_KEY}"})
    assert 400 <= status < 500 and json.loads(raw)["error"]["param"] == "model"


# --- greedy output equals `generate` ------------------------------------------------------------------------

PROMPT, N = "The river carried", 12


@pytest.fixture(scope="module")
def generated(model_dir) -> dict:
    """`generate --json` for the same prompt and budget, through main() in this process (the console script's
    code; an interpreter of its own would only add its start-up)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(map(str, ["generate", model_dir, *OFFLOAD, "--prompt", PROMPT, "--max-new-tokens", N,
                                 "--ignore-eos", "--json"])))
    assert rc == 0, err.getvalue()
    result = json.loads(out.getvalue())
    assert len(result["token_ids"]) == N
    return result


def _stream_text(port: int, body: dict) -> tuple[str, list[dict]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        data = [line[len(b"data: "):].strip() for line in resp if line.startswith(b"data: ")]
    finally:
        conn.close()
    assert data[-1] == b"[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), chunks


def test_greedy_completion_equals_generate(plain, generated):
    body = {"model": "tiny-qwen", "prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    status, raw = http_call(plain.port, "POST", "/v1/completions", body)
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["choices"][0]["text"] == generated["text"]
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == N
    text, chunks = _stream_text(plain.port, {**body, "stream_options": {"include_usage": True}})
    assert text == generated["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == N


# --- SIGTERM while a stream runs ---------------------------------------------------------------------------


class _StreamReader(threading.Thread):
    """Reads one long SSE stream to its end (or its cut), noting when the first data line came."""

    def __init__(self, port: int, body: dict):
        super().__init__(daemon=True)
        self.port, self.body = port, body
        self.first = threading.Event()
        self.lines: list[bytes] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(self.body),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            for line in resp:
                if line.startswith(b"data: "):
                    self.lines.append(line[len(b"data: "):].strip())
                    self.first.set()
        except (OSError, http.client.HTTPException) as exc:   # the connection cut mid-chunk
            self.error = exc
        finally:
            conn.close()
            self.first.set()


def test_sigterm_during_a_long_stream_exits_0_and_frees_the_port(model_dir, tmp_path):
    server = ServeProcess(model_dir, tmp_path, "--shutdown-timeout", SHUTDOWN_S)
    try:
        server.wait_ready()
        reader = _StreamReader(server.port, {"model": "tiny-qwen", "prompt": "The river", "max_tokens": 300,
                                             "temperature": 0, "ignore_eos": True, "stream": True})
        reader.start()
        assert reader.first.wait(60) and reader.lines, f"no first chunk: {reader.error!r}\n{server.stderr}"
        assert b"[DONE]" not in reader.lines   # the stream runs when the signal comes
        server.proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        rc = server.proc.wait(timeout=SHUTDOWN_S + EXIT_MARGIN_S)
        took = time.monotonic() - start
        reader.join(timeout=30)
    finally:
        server.stop()
    assert rc == 0, server.stderr
    assert took <= SHUTDOWN_S + EXIT_MARGIN_S
    assert "stopped by SIGTERM" in server.stderr
    assert "Traceback" not in server.stderr, server.stderr   # a stream cut at the timeout is an expected end
    assert not reader.is_alive(), "the stream neither ended nor was cut when the server exited"
    ended = reader.lines[-1] == b"[DONE]"
    chunks = [json.loads(d) for d in (reader.lines[:-1] if ended else reader.lines)]   # whole chunks either way
    assert chunks and all(c["object"] == "text_completion" for c in chunks)
    if ended:   # it ran to its end within the shutdown timeout: the last chunk says why it ended
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert not listening(server.port)
