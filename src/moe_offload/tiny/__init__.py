"""make-tiny: small random-weight MoE checkpoints of real families, made here and saved as transformers saves them.

make (make_tiny: checks and the config asked for), write (the folder written: streamed weights, atomic rename),
families (each family's config fields and quirks, as data), heads (the attention sizes a family can take),
tokenizer (the BPE trained here), released (the released on-disk layout where save_pretrained's departs from it),
quantize (the fp8 / mxfp4 rewrite of a saved checkpoint), like_config and make_like (make-tiny --like: a released
config.json's every dimension and field; like/ holds the bundled ones).
May import: errors, prompts, formats.
"""
