"""The tiny models' tokenizer: a byte-level BPE trained here on :data:`moe_offload.prompts.CORPUS`.

`build_tokenizer` trains it with exactly the vocabulary size asked for (topped up with reserved special
tokens); make.py saves it beside the weights as ``tokenizer.json`` + ``tokenizer_config.json``.
"""

from __future__ import annotations

__all__ = ["SPECIAL_TOKENS", "VISION_TOKENS", "BYTE_ALPHABET", "build_tokenizer"]

# Special tokens of the tiny tokenizer. Llama order (<unk>, <s>, </s>) plus a pad token.
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD)
# Qwen3-VL looks these ids up in input_ids; give them real tokens inside the tiny vocab
# instead of Qwen's 151k-range ids, which would be out of range for a 512-token embedding.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
BYTE_ALPHABET = 256  # a byte-level BPE always keeps all 256 byte symbols


def build_tokenizer(vocab_size: int, specials: tuple[str, ...], max_len: int):
    """Train a byte-level BPE on the built-in corpus with exactly ``vocab_size`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from ..prompts import CORPUS, PROMPTS

    tok = Tokenizer(models.BPE(unk_token=UNK))
    # GPT-2 style byte-level pipeline: any UTF-8 text encodes without <unk>, and decoding
    # gives back the exact input.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [para for para in CORPUS.split("\n\n") if para.strip()] + list(PROMPTS)
    tok.train_from_iterator(texts, trainer=trainer)
    # A few KB of text only supports so many merges; top a large vocab up with reserved
    # special tokens (as Llama 3 and Qwen do) so the size is exactly what was asked for.
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    bos_id = tok.token_to_id(BOS)
    # Prepend <s> like Llama/Mixtral tokenizers, so a prompt never starts the model cold.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=max_len,
    )
    if len(fast) != vocab_size:  # pragma: no cover - guards against a tokenizers change
        raise RuntimeError(f"tiny tokenizer has {len(fast)} tokens, expected {vocab_size}")
    return fast
