"""Every place moe-offload reaches into transformers beyond its documented API, in one module, with the version
range it was written against.

The package declares `transformers>=5.0,<6` (pyproject.toml). What it relies on there beyond the public API:

- the experts registry (`transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`, the 5.x experts interface: run/experts.py
  registers through it) and `set_experts_implementation`;
- the attention and mask registries (`AttentionInterface`, `AttentionMaskInterface`: run/decode_attention.py
  registers its decode attention with SDPA's mask through them) and `set_attn_implementation`, and that continuous
  batching refuses any attention implementation but its own (serve sets SDPA back);
- `CompileConfig._compile_all_devices`: generate compiles its decode step only on accelerators unless asked;
- continuous batching's per-request logits processors (`ContinuousBatchingLogitsProcessor`, the manager's
  `logit_processor` list and its `tensors_required` / `do_processing` counters) for serve's sampler;
- the manager's output router (`output_router.result_handlers` under its `_lock`): a cancelled request gets no
  finished output, so its result handler is dropped here.

`check_version` refuses a transformers outside the range with an `error:` that names the installed version; the
loader calls it before anything is built.
"""

from __future__ import annotations

SUPPORTED = (5, 6)   # major versions: >= 5.0, < 6 (pyproject.toml's dependency)

try:   # continuous batching's per-request processor interface (transformers 5.x)
    from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor
except ImportError:   # pragma: no cover - a transformers without it: serve decodes greedily only (and says so)
    ContinuousBatchingLogitsProcessor = object


def check_version(version: str | None = None) -> None:
    """Raise ConfigError when the installed transformers (or `version`) is outside the supported range."""
    from ..errors import ConfigError

    version = installed() if version is None else version
    try:
        major = int(version.split(".")[0])
    except ValueError:
        major = -1
    if not SUPPORTED[0] <= major < SUPPORTED[1]:
        raise ConfigError(f"transformers {version} is installed, and moe-offload runs on transformers >= "
                          f"{SUPPORTED[0]}.0, < {SUPPORTED[1]} (its experts registry and continuous batching as "
                          f"they are there): pip install 'transformers>={SUPPORTED[0]},<{SUPPORTED[1]}'")


def installed() -> str:
    """The version of the transformers this process imports."""
    import transformers

    return transformers.__version__


def compile_on_every_device(compile_config) -> None:
    """Ask generate to compile its decode step on any device (it does so by itself only on accelerators)."""
    compile_config._compile_all_devices = True


def add_logits_processor(manager, processor) -> bool:
    """Add a per-request logits processor to a continuous batching manager that has not started; False where this
    transformers' manager has no place for one."""
    processors = getattr(manager, "logit_processor", None)
    if ContinuousBatchingLogitsProcessor is object or processors is None or not hasattr(processors, "logits_processor"):
        return False
    processors.logits_processor.append(processor)
    processors.tensors_required += 1
    processors.do_processing = True
    return True


def drop_result_handler(manager, request_id: str) -> None:
    """Forget a request's result handler (a cancelled sequence gets no finished output, which is what drops it)."""
    router = manager.output_router
    with router._lock:
        router.result_handlers.pop(request_id, None)
