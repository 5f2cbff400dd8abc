"""The model as data: configs checked, every tensor listed with its bytes, each given its role.

config_check (configs validated before transformers builds anything), config (config.json read, storage
dtypes, the meta model built), checkpoint (safetensors files and headers), inventory (TensorRecord per
parameter and buffer, from a config, a checkpoint's headers or a live module), roles (routed expert,
router, attention, ...), published (full-size configs of released models). May import: errors, formats.
"""
