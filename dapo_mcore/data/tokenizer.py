"""The tokenizer that ships with dapo_mcore: one token per printable ASCII character.

It is a real Hugging Face fast tokenizer (tokenizer.json + tokenizer_config.json), so the HF engine, vLLM
and SGLang load it from a model directory like any other. It exists so that the CPU demo and the tests
need no download; real runs use their model's own tokenizer.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
# Newline plus the 95 printable ASCII characters: 100 tokens with the specials (divisible by TP 2 and 4).
CHARSET = "\n" + "".join(chr(c) for c in range(32, 127))


def build_char_tokenizer(out_dir: str | Path) -> None:
    """Write the char tokenizer's files into out_dir (typically a model directory)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *CHARSET))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(str(out_dir))


def vocab_size() -> int:
    return len(SPECIAL_TOKENS) + len(CHARSET)
