"""make-tiny: small random-weight MoE checkpoints of real families, made here and saved as transformers saves them.

make (make_tiny: checks and writing), families (each family's config fields and quirks, as data), tokenizer
(the byte-level BPE trained here) and quantize (the fp8 / mxfp4 rewrite of a saved checkpoint).
May import: errors, prompts, formats.
"""
