"""The tiny models' tokenizer: a BPE trained here on :data:`moe_offload.prompts.CORPUS`, in the style of the family.

`build_tokenizer` trains it with exactly the vocabulary size asked for (topped up with reserved special
tokens); make.py saves it beside the weights as ``tokenizer.json`` + ``tokenizer_config.json``. Two styles:

- byte-level BPE (GPT-2's pipeline: `pre_tokenizers.ByteLevel`, whose split regex is GPT-2's
  ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`` over GPT-2's byte-to-unicode
  alphabet, no prefix space, merges not ignored), for every family but those below;
- SentencePiece-style BPE (`SENTENCEPIECE_STYLE`: Jamba), as the released Llama-family tokenizer.json files
  are: ``▁`` for spaces (Metaspace; no dummy prefix, as Jamba's), 256 ``<0xNN>`` byte-fallback tokens in the
  vocabulary, and a ByteFallback/Fuse/Replace decoder. llama.cpp's converter reads Jamba's vocabulary only from a
  SentencePiece ``tokenizer.model`` or from such a tokenizer.json (`gguf.LlamaHfVocab`: BPE with
  ``byte_fallback`` and a ``Sequence`` decoder); it has no byte-level fallback for Jamba.

Family special tokens (`FAMILY_TOKENS`) sit beside ``<unk> <s> </s> <pad>``: Qwen3-VL's vision placeholders
(looked up in input_ids), and the GLM-4.5 tokens llama.cpp's converter looks up by name (`_set_vocab_glm`:
``[gMASK]`` as BOS, ``<|user|>`` as EOT, ``<|endoftext|>`` as UNK, ``<|observation|>`` as EOM).

llama.cpp and the byte-level tokenizer: the converter names a BPE pre-tokenizer by hashing the ids a fixed
text encodes to (`get_vocab_base_pre`, chkhsh). Those ids depend on the vocabulary, so a vocabulary trained
here never hashes to a known name, and a known tokenizer's vocabulary cannot be had here (no hub). It is kept,
and the converter is told its pre-tokenizer: **"gpt-2"**. That name maps to llama.cpp's
LLAMA_VOCAB_PRE_TYPE_GPT2, whose split is exactly the regex above (llama-vocab.cpp; unicode.cpp runs it as
`unicode_regex_split_custom_gpt2`, written for that very regex including its trailing ``\\s+``), over GPT-2 byte
encoding with merges applied as ranked, as `tokenizers`' ByteLevel + BPE do. "qwen2" or "llama-bpe" would be
wrong: their regexes split digits one by one / case-insensitive contractions and 1-3 digit groups. The token
ids then agree between transformers and llama.cpp for text prompts, not only for token-id ones.
"""

from __future__ import annotations

__all__ = ["SPECIAL_TOKENS", "VISION_TOKENS", "GLM_TOKENS", "FAMILY_TOKENS", "SENTENCEPIECE_STYLE",
           "BYTE_ALPHABET", "RESERVED_SPECIAL", "LLAMA_CPP_PRE_TOKENIZER", "family_special_tokens", "build_tokenizer"]

# Special tokens of the tiny tokenizer. Llama order (<unk>, <s>, </s>) plus a pad token.
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD)
# Qwen3-VL looks these ids up in input_ids; give them real tokens inside the tiny vocab
# instead of Qwen's 151k-range ids, which would be out of range for a 512-token embedding.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# Released GLM-4.5 / 4.6 tokenizers' special tokens that llama.cpp's converter looks up (in their order there:
# ids 151329, 151331, 151336, 151338).
GLM_TOKENS = ("<|endoftext|>", "[gMASK]", "<|user|>", "<|observation|>")
FAMILY_TOKENS: dict[str, tuple[str, ...]] = {"qwen3_vl_moe": VISION_TOKENS, "glm4_moe": GLM_TOKENS}
# Families whose released tokenizer is SentencePiece BPE, and whose llama.cpp converter reads nothing else.
SENTENCEPIECE_STYLE = frozenset({"jamba"})
# Reserved tokens of a vocabulary larger than the corpus supports: the first RESERVED_SPECIAL are added special
# tokens, the rest ordinary vocabulary entries (_fill_vocab says why).
RESERVED_SPECIAL = 1024
BYTE_ALPHABET = 256  # all 256 byte symbols: a byte-level alphabet, or SentencePiece's <0xNN> byte fallback
# The name llama.cpp's converter is to be given for the byte-level tokenizer (see the module docstring).
LLAMA_CPP_PRE_TOKENIZER = "gpt-2"
_SPACE = "\u2581"  # SentencePiece's visible space, ▁


def family_special_tokens(family: str) -> tuple[str, ...]:
    """The special tokens of `family`'s tiny tokenizer, in id order from 0."""
    return SPECIAL_TOKENS + FAMILY_TOKENS.get(family, ())


def _byte_tokens() -> list[str]:
    return [f"<0x{i:02X}>" for i in range(BYTE_ALPHABET)]


def _byte_level(vocab_size: int, specials: tuple[str, ...]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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
    return tok, trainer


def _sentencepiece_style(vocab_size: int, specials: tuple[str, ...], texts: list[str]):
    """A Llama-style BPE: Metaspace words, <0xNN> byte fallback for any character outside the vocabulary."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK, fuse_unk=True))
    # Words split at spaces to train (no merge crosses a word); the saved tokenizer does not split, as
    # Llama's tokenizer.json. No ▁ is prepended to the text: Jamba's SentencePiece model has no dummy prefix
    # (llama.cpp's converter writes add_space_prefix false for it), so both tokenize text alike.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme="never", split=True)
    fixed = len(specials) + BYTE_ALPHABET
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials) + _byte_tokens(),
        limit_alphabet=max(0, vocab_size - fixed),  # characters beyond it fall back to bytes
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # The byte tokens are ordinary vocabulary entries (as in Llama's tokenizer.json), not added tokens.
    data = json.loads(tok.to_str())
    byte_names = set(_byte_tokens())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in byte_names]
    data["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(data))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme="never", split=False)
    # Bytes first, then ▁ -> space: a ▁ that fell back to bytes (a vocabulary too small to hold it) is a space too.
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Replace(_SPACE, " ")])
    return tok


def _fill_vocab(tok, count: int, *, first: int):
    """`tok` with `count` more ordinary vocabulary entries ``<|reserved_{first}|>``, ... at the next ids (before
    the added reserved tokens: `tokenizers` numbers added tokens after the model's vocabulary when it loads one).

    Beyond RESERVED_SPECIAL the top-up goes into the BPE model's vocabulary rather than the added tokens:
    `tokenizers` builds a matcher over every added token each time a tokenizer loads (152k of them, Qwen3's
    vocabulary size, took 3.9 s a load and 28 MB on disk; as vocabulary entries 0.1 s and 5 MB). No merge
    produces them, so text never encodes to them; decoded, they read as their names (their characters are
    printable ASCII, which the byte-level alphabet maps to themselves)."""
    import json

    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    start = tok.get_vocab_size(with_added_tokens=True)
    assert start == len(vocab), "added tokens outside the model's vocabulary come after it"
    for i in range(count):
        vocab[f"<|reserved_{first + i}|>"] = start + i
    return Tokenizer.from_str(json.dumps(data))


def build_tokenizer(vocab_size: int, family: str, max_len: int):
    """Train `family`'s tiny tokenizer on the built-in corpus with exactly ``vocab_size`` tokens."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    from ..prompts import CORPUS, PROMPTS

    specials = family_special_tokens(family)
    texts = [para for para in CORPUS.split("\n\n") if para.strip()] + list(PROMPTS)
    if family in SENTENCEPIECE_STYLE:
        tok = _sentencepiece_style(vocab_size, specials, texts)
    else:
        tok, trainer = _byte_level(vocab_size, specials)
        tok.train_from_iterator(texts, trainer=trainer)
    # A few KB of text only supports so many merges; top a large vocab up with reserved
    # special tokens (as Llama 3 and Qwen do) so the size is exactly what was asked for.
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing > RESERVED_SPECIAL:
        tok = _fill_vocab(tok, missing - RESERVED_SPECIAL, first=RESERVED_SPECIAL)
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(min(missing, RESERVED_SPECIAL))])
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
