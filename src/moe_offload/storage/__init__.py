"""Storage: where offloaded weights are held.

host (the exact-size host arena, pinned and mapped where an accelerator allows, device resolution),
disk (safetensors byte ranges read straight from the checkpoint, O_DIRECT) and disk_prefetch (a layer's
dense disk tensors read one layer ahead). May import: errors, formats, planning.
"""
