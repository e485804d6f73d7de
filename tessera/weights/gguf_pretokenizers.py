"""How a GGUF's byte-level BPE vocabulary splits text before its merges, for the
`tokenizer.ggml.pre` names transformers' GGUF tokenizer conversion does not know.

llama.cpp's converter records which pre-tokenizer the original Hugging Face tokenizer had
(`tokenizer.ggml.pre`), and llama.cpp splits text with that tokenizer's regexes, in order,
each splitting the pieces the one before left. transformers knows some names (Llama 3's,
Qwen2's, GPT-4o's, ...); for the rest its conversion splits as GPT-2 does, so DeepSeek-V3's
numbers (three digits a piece in the original) or its CJK runs come out as other tokens than
the model was trained on. The regexes below are those llama.cpp uses for these names (and
the originals' tokenizer.json have); names neither knows are logged, as llama.cpp warns."""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_GLM4 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK_V3 = (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
                r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# (the Greek oxia letters, U+2126 and U+212A as escapes: canonical equivalence would turn
# them into other letters, and two ranges empty, in any editor that normalises text)
_DEEPSEEK_LLM_LETTERS = (
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7d"
    "ᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ"
    "\U00010400-\U0001044f𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+")
_DIGITS_THEN_GPT2 = (r"\p{N}", _GPT2)  # each digit alone, then GPT-2's split (SmolLM's, StarCoder's)

SPLITS: dict[str, tuple[str, ...]] = {
    "deepseek-v3": (r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+", _DEEPSEEK_V3),
    "deepseek-llm": ("[\r\n]", _DEEPSEEK_LLM_LETTERS, r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$", "[一-龥ࠀ-一가-퟿]+",
                     r"\p{N}+"),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"),
    "glm4": (_GLM4,), "chatglm-bpe": (_GLM4,),
    **{name: _DIGITS_THEN_GPT2 for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                                           "minerva-7b")},
}
# names whose split is GPT-2's, which transformers' conversion applies anyway
GPT2_SPLIT = frozenset({"gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
                        "mpt", "olmo", "jais", "exaone4", "roberta-bpe", "jina-v1-en", "jina-v2-code"})


def apply_gguf_pretokenizer(tokenizer: Any, fields: dict) -> None:
    """Give a byte-level BPE `tokenizer` converted from a GGUF (a PreTrainedTokenizerFast)
    the split its `tokenizer.ggml.pre` names, where transformers did not."""
    from tokenizers import Regex, pre_tokenizers

    from tessera.weights.gguf_rope import field_value

    if field_value(fields, "tokenizer.ggml.model") != "gpt2":
        return
    pre = field_value(fields, "tokenizer.ggml.pre")
    known = _known_to_transformers()
    if pre is None or pre in GPT2_SPLIT or (known is not None and pre in known):
        return
    splits = SPLITS.get(pre)
    if splits is None:
        if known is not None:  # (an older transformers converts these its own way)
            logger.warning("GGUF pre-tokenizer %r is unknown to tessera and transformers: text is split as GPT-2 "
                           "splits it, which may give other tokens than the original tokenizer; its Hugging Face "
                           "folder tokenizes exactly", pre)
        return
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(expr), behavior="isolated") for expr in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _known_to_transformers() -> frozenset[str] | None:
    """The names transformers' conversion splits by (None: a version without that table)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:
        return None
    return frozenset(GGUF_PRE_TOKENIZER_SPLITS)
