"""`serve`: the port bound first (a port in use is an error before any weight is read), then the model loaded
by the caller, then uvicorn over the app until SIGTERM or Ctrl-C.

Shutdown: on SIGTERM (or SIGINT) uvicorn stops accepting at once, lets running requests finish for up to
`shutdown_timeout` seconds and cancels what is left; then the decoding thread stops and the process exits 0.
(uvicorn re-raises the signal once it is done; the handlers installed here take it, so the exit is a clean 0
and not a death by signal.)
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import sys
from dataclasses import dataclass

from ..errors import MoeOffloadError
from .engine import Engine, Limits, kv_bytes_per_token


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    served_name: str = "model"
    max_concurrency: int = 8
    max_queue: int = 64
    api_key: str | None = None
    context: int = 2048
    page_size: int = 64
    shutdown_timeout: float = 10.0

    @property
    def limits(self) -> Limits:
        return Limits(self.max_concurrency, self.max_queue, self.context, self.page_size)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or the error a user can act on."""
    if not 0 <= port <= 65535:
        raise MoeOffloadError(f"--port {port}: give a port from 0 to 65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise MoeOffloadError(f"--host {host}: cannot resolve it ({exc.strerror}); give an address such as "
                              "127.0.0.1 or 0.0.0.0") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise MoeOffloadError(f"port {port} on {host} is in use (another server is listening there): stop it, "
                                  "or give another --port") from None
        raise MoeOffloadError(f"cannot listen on {host}:{port}: {exc.strerror}; give another --host / --port") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def check_options(opts: ServeOptions, model_context: int) -> None:
    if opts.max_concurrency < 1:
        raise MoeOffloadError(f"--max-concurrency {opts.max_concurrency}: give at least 1 sequence")
    if opts.max_queue < 0:
        raise MoeOffloadError(f"--max-queue {opts.max_queue}: give 0 (refuse when every slot is busy) or more")
    if not 1 <= opts.context <= model_context:
        raise MoeOffloadError(f"--max-model-len {opts.context}: give 1 to the model's context of {model_context} "
                              "tokens")


def kv_cache_bytes(model, opts: ServeOptions) -> int:
    return opts.limits.kv_blocks * opts.page_size * kv_bytes_per_token(model.config, model.dtype.itemsize)


@dataclass
class Served:
    """A server made and not yet run: uvicorn's server over the app, the engine and the meter it needs."""

    server: object          # uvicorn.Server
    engine: Engine
    meter: object           # metrics.Meter
    metrics: object         # metrics.Metrics

    def close(self) -> None:
        self.engine.stop()
        self.meter.close()


def make_server(model, plan, tokenizer, opts: ServeOptions) -> Served:
    """The app over a started engine, in a uvicorn server (run it with `.server.run(sockets=[sock])`, in the
    main thread to take SIGTERM, or in another where a test drives it; then `.close()`)."""
    import uvicorn

    from .app import build_app
    from .metrics import Meter, Metrics

    meter = Meter(model)
    engine = Engine(model, tokenizer, opts.limits)
    metrics = Metrics(meter, plan, served_name=opts.served_name, kv_bytes=kv_cache_bytes(model, opts),
                      status=lambda: (engine.running, engine.waiting))
    engine.metrics = metrics
    app = build_app(engine, tokenizer, served_name=opts.served_name, context=opts.context, api_key=opts.api_key,
                    metrics=metrics)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=opts.shutdown_timeout,
                            lifespan="off", access_log=False)
    engine.start()
    return Served(uvicorn.Server(config), engine, meter, metrics)


class _QuietCancels(logging.Filter):
    """uvicorn logs the streams it cancels at the shutdown timeout as "Exception in ASGI application" with a
    traceback: an expected end, not an error, once the server is told to exit."""

    def __init__(self, server):
        super().__init__()
        self.server = server

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (self.server.should_exit and isinstance(exc, asyncio.CancelledError))


def run(model, plan, tokenizer, sock: socket.socket, opts: ServeOptions, *, announce=print) -> int:
    """Serve until SIGTERM / SIGINT (from the main thread); returns the exit status (0)."""
    served = make_server(model, plan, tokenizer, opts)
    quiet = _QuietCancels(served.server)
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addFilter(quiet)
    stopped: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, _f: stopped.append(s)) for sig in (signal.SIGTERM, signal.SIGINT)}
    host, port = sock.getsockname()[:2]
    announce(f"serving {opts.served_name!r} on http://{host}:{port}/v1 (max {opts.max_concurrency} sequences "
             f"together, {opts.max_queue} waiting); SIGTERM or Ctrl-C stops")
    try:
        served.server.run(sockets=[sock])
    finally:
        served.close()
        sock.close()
        uvicorn_log.removeFilter(quiet)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stopped:
        print(f"stopped by {signal.Signals(stopped[0]).name}: the running requests ended or were cancelled after "
              f"--shutdown-timeout {opts.shutdown_timeout:g} s; the server is down", file=sys.stderr)
    return 0
