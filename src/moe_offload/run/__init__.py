"""Run: how a loaded model reads its offloaded weights while it runs, and what that costs.

runtime (backends, hooks), state (counters, staging buffers, routing state the readers share), experts (the
experts function: only the selected experts read), dense_prefetch (the prefetch backend's dense ring), device_cache,
disk_tier, quant_weights (quantized tensors dequantized right before use), transforms,
offloader (`Offloader.wrap_modules`), auditor. May import: errors, formats, model, planning, routing, storage.
"""
