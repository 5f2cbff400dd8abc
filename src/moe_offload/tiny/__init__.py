"""make-tiny: small random-weight MoE checkpoints of real families, made here and saved as transformers saves them.

May import: errors, prompts, formats.
"""
