"""A byte-level BPE tokenizer (transformers' fast tokenizer) from GGUF ``tokenizer.ggml.*`` metadata."""

from __future__ import annotations

import logging

from .errors import ModelLoadError
from .gguf_meta import meta_scalar, meta_value

log = logging.getLogger("mlx_kvcache")


_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp pre-tokenizer names whose regex is GPT-2's with digits split one by one.
_DIGITS_GPT2 = {"smollm", "starcoder", "refact", "codeshell", "exaone", "minerva-7b"}


def _pre_tokenizer(pre: str | None, path: str):
    from tokenizers import Regex, pre_tokenizers as pt

    bl = pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in (None, "default", "gpt2", "gpt-2", "olmo", "jais", "poro-chat", "viking"):
        return bl
    if pre in _DIGITS_GPT2:
        return pt.Sequence([pt.Digits(individual_digits=True), bl])
    regex = {"llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX, "smaug-bpe": _LLAMA3_REGEX,
             "qwen2": _QWEN2_REGEX}.get(pre)
    if regex is not None:
        return pt.Sequence([
            pt.Split(Regex(regex), behavior="isolated", invert=False),
            pt.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    log.warning("%s: unknown GGUF pre-tokenizer %r; using the GPT-2 byte-level regex", path, pre)
    return bl


def build_tokenizer(meta: dict, path: str = "<gguf>"):
    """TokenizerWrapper from GGUF `tokenizer.ggml.*` metadata (byte-level BPE only)."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    kind = meta_value(meta, "tokenizer.ggml.model")
    if kind is None:
        raise ModelLoadError(f"{path}: GGUF file has no tokenizer (tokenizer.ggml.model missing)")
    if kind != "gpt2":
        raise ModelLoadError(
            f"{path}: tokenizer model {kind!r} is not supported (only 'gpt2' byte-level BPE)"
        )
    tokens = meta_value(meta, "tokenizer.ggml.tokens", required=True, path=path)
    merges = meta_value(meta, "tokenizer.ggml.merges", required=True, path=path)
    ttypes = meta_value(meta, "tokenizer.ggml.token_type", None)
    if not isinstance(tokens, list) or not isinstance(merges, list):
        raise ModelLoadError(f"{path}: malformed tokenizer vocabulary / merges")
    if ttypes is None:
        ttypes = [1] * len(tokens)
    if len(ttypes) != len(tokens):
        raise ModelLoadError(f"{path}: token_type has {len(ttypes)} entries for {len(tokens)} tokens")

    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ModelLoadError(f"{path}: malformed BPE merge {m!r}")
        pairs.append((a, b))
    bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(meta_value(meta, "tokenizer.ggml.pre"), path)
    tok.decoder = decoders.ByteLevel()

    # Token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    control = [tokens[i] for i, t in enumerate(ttypes) if t in (2, 3)]
    user = [tokens[i] for i, t in enumerate(ttypes) if t == 4]
    if control:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    def tok_of(key):
        i = meta_value(meta, key)
        if i is None or not (0 <= int(i) < len(tokens)):
            return None
        return tokens[int(i)]

    bos, eos = tok_of("tokenizer.ggml.bos_token_id"), tok_of("tokenizer.ggml.eos_token_id")
    unk, pad = tok_of("tokenizer.ggml.unknown_token_id"), tok_of("tokenizer.ggml.padding_token_id")
    add_bos = bool(meta_value(meta, "tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta_value(meta, "tokenizer.ggml.add_eos_token", False))
    post = [processors.ByteLevel(trim_offsets=False)]
    use_bos, use_eos = bool(add_bos and bos), bool(add_eos and eos)
    if use_bos or use_eos:
        single = ([bos] if use_bos else []) + ["$A"] + ([eos] if use_eos else [])
        specials = {t: vocab[t] for t in ([bos] if use_bos else []) + ([eos] if use_eos else [])}
        post.append(processors.TemplateProcessing(single=" ".join(single),
                                                  special_tokens=list(specials.items())))
    tok.post_processor = processors.Sequence(post)

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos, eos_token=eos, unk_token=unk, pad_token=pad,
        chat_template=meta_value(meta, "tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
        model_max_length=meta_scalar(meta, "llama.context_length", int, 1 << 30),
    )
    extra_eos = []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        i = meta_value(meta, key)
        if i is not None and 0 <= int(i) < len(tokens):
            extra_eos.append(int(i))
    eos_ids = ([vocab[eos]] if eos else []) + extra_eos
    return TokenizerWrapper(hf, BPEStreamingDetokenizer, eos_token_ids=eos_ids)

