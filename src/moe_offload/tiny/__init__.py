"""make-tiny: small random-weight MoE checkpoints of real families, made here and saved as transformers saves them.

make (make_tiny: checks and writing), families (each family's config fields and quirks, as data), heads (the
attention sizes a family can take), tokenizer (the BPE trained here), released (the released on-disk layout
where save_pretrained's departs from it) and quantize (the fp8 / mxfp4 rewrite of a saved checkpoint).
May import: errors, prompts, formats.
"""
