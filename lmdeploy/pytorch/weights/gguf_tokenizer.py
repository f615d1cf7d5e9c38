"""A GGUF file's tokenizer as a Hugging Face tokenizer folder (transformers reads the file's vocabulary)."""
from __future__ import annotations

import json
from pathlib import Path

from gguf import GGUFReader

from .gguf_keys import metadata

# llama.cpp pre-tokenizers that transformers reads as another one with the same split
PRE_TOKENIZER_SPLITS = {'chatglm-bpe': 'llama-bpe', 'glm4': 'llama-bpe'}


def save_tokenizer(gguf_path: Path, out_dir: Path, reader: GGUFReader) -> None:
    """The file's tokenizer saved in ``out_dir`` as transformers writes it, with its added tokens in
    tokenizer_config.json."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import set_split_regex
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    # AutoTokenizer reads a GGUF tokenizer only where transformers reads the model too (not GLM, SmolLM3), and
    # would save a byte-level vocabulary of a Gemma file as GemmaTokenizer, which rebuilds it as SentencePiece's
    arch = metadata(reader, 'general.architecture')
    byte_level_gemma = arch.startswith('gemma') and metadata(reader, 'tokenizer.ggml.model') == 'gpt2'
    supported = arch in GGUF_SUPPORTED_ARCHITECTURES and not byte_level_gemma
    loader = AutoTokenizer if supported else PreTrainedTokenizerFast
    tokenizer = loader.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    split = PRE_TOKENIZER_SPLITS.get(metadata(reader, 'tokenizer.ggml.pre'))
    if split is not None:
        set_split_regex(tokenizer, {'pre_tokenizer_type': split})
    tokenizer.save_pretrained(str(out_dir))
    # Without its added tokens in tokenizer_config.json, every load parses tokenizer.json a second time for them
    # (a third of the load of Gemma 3's 33 MB file)
    config_path = out_dir / 'tokenizer_config.json'
    config = json.loads(config_path.read_text())
    config['added_tokens_decoder'] = {str(i): token.__getstate__() for i, token in
                                      tokenizer.added_tokens_decoder.items()}
    if type(tokenizer).__name__ == 'GemmaTokenizer':
        # GemmaTokenizer rebuilds in Python the pipeline that its tokenizer.json holds; TokenizersBackend reads the
        # file in Rust alone: the same tokens, texts and attributes (tests/test_gguf_tokenizer_class.py)
        config |= {'tokenizer_class': 'TokenizersBackend', 'padding_side': tokenizer.padding_side}
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
