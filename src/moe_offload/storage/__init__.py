"""Storage: where offloaded weights are held.

host (the exact-size host arena, pinned and mapped where an accelerator allows, device resolution) and
disk (safetensors byte ranges read straight from the checkpoint, O_DIRECT). May import: errors, formats,
planning.
"""
