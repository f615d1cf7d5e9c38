"""GLM-4 from llama.cpp's ``chatglm`` GGUF files: a tiny random ``GlmForCausalLM`` and a GLM-4-style tokenizer
written as convert_hf_to_gguf.py's ChatGLMModel writes them, from a ``GlmForCausalLM`` checkpoint (q, k and v
apart) or from GLM-4-9B-chat's own (``query_key_value`` fused), in F32, F16, Q8_0 and Q4_K; served by the
engine token for token like transformers on the original, with its tokenizer encoding text as the original's."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, GlmConfig, PreTrainedTokenizerFast

from family_checks import assert_matches_transformers
from helpers import assert_same_state, make_engine, random_prompts
from test_gguf import finish

from lmdeploy.pytorch.weights.gguf import convert_gguf

# GLM-4's tokenizer: Llama 3's split (digits in threes), byte-level BPE, its special tokens after the vocabulary
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL = ['<|endoftext|>', '[MASK]', '[gMASK]', '[sMASK]', '<sop>', '<eop>', '<|system|>', '<|user|>',
           '<|assistant|>', '<|observation|>']
CHAT_TEMPLATE = ("[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CORPUS = ["In 2024 we counted 1234567 birds, 365 days, 345 and 3456 hours.",
          "I'm sure it's THEIR'S, isn't it? We'll see.", "def f(x):\n    return x * 42\n\n\nprint(f(10))",
          'héllo 世界 naïve café', 'well, well, well... hello world!']
TEXTS = ['12345678 and 2024-12-05', "HELLO'S they'RE here\n\n   indented\tx", 'héllo 世界 café!!!',
         '[gMASK]<sop><|user|>\nwhat is 1+1?<|assistant|>\n2<|endoftext|>', ' leading  and trailing  ']
# llama.cpp's heads are hidden_size / heads wide (the files state no key_length)
SHAPES = {'small': dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16),
          'q4_k': dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64)}
PROJECTIONS = tuple(f'{name}_proj.weight' for name in ('q', 'k', 'v', 'o', 'gate_up', 'down'))


def glm4_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLIT), behavior='isolated'),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=300,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(SPECIAL)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token='<|endoftext|>', pad_token='<|endoftext|>',
                                   chat_template=CHAT_TEMPLATE)


def save_glm(path: Path, own_layout: bool, shape: str) -> str:
    """A random ``GlmForCausalLM`` with GLM-4's tokenizer and end tokens and a padded vocabulary. Its eps and rope
    base are what the file will state: GLM-4-9B-chat's own (``own_layout``: ChatGLMModel reads its
    ``layernorm_epsilon`` and ``rope_ratio``), else the 1e-5 and 10000 that it writes for a ``GlmForCausalLM``."""
    tokenizer = glm4_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(['<|endoftext|>', '<|user|>', '<|observation|>'])
    config = GlmConfig(**SHAPES[shape], num_hidden_layers=2, vocab_size=len(tokenizer) + 6,
                       max_position_embeddings=1024, eos_token_id=ids, pad_token_id=ids[0], bos_token_id=None,
                       rms_norm_eps=1.5625e-07 if own_layout else 1e-5,
                       rope_parameters={'rope_type': 'default', 'rope_theta': 5e6 if own_layout else 1e4,
                                        'partial_rotary_factor': 0.5})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


def round_trip(hf: torch.nn.Module, qtype: Q, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``hf``'s 2-D weights (F16) or decoder projections (Q8_0, Q4_K) as the file stores them, and ``hf`` set
    to what the file holds. Q4_K cannot be quantized by gguf-py: random blocks with small scales."""
    stored = {}
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if qtype == Q.F16 and param.dim() == 2:
                stored[name] = param.numpy().astype(np.float16)
            elif qtype == Q.Q8_0 and name.endswith(PROJECTIONS):
                stored[name] = gguf.quants.quantize(param.numpy(), Q.Q8_0)
            elif qtype == Q.Q4_K and name.endswith(PROJECTIONS):
                blocks = rng.integers(0, 256, (param.shape[0], param.shape[1] // 256, 144), dtype=np.uint8)
                blocks[..., :4] = rng.uniform(1e-4, 1e-3, blocks.shape[:2] + (2,)).astype(np.float16).view(np.uint8)
                stored[name] = blocks.reshape(param.shape[0], -1)
            if name in stored:
                param.copy_(torch.from_numpy(np.asarray(gguf.quants.dequantize(stored[name], qtype), np.float32)))
    return stored


def add_vocab(writer: gguf.GGUFWriter, folder: str, vocab_size: int) -> None:
    """ChatGLMModel.set_vocab for GLM-4: the vocabulary padded to the model's, added special tokens as control
    tokens, the merges and chat template through gguf-py's SpecialVocab, ``<|user|>`` as end of turn."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    reverse = {index: token for token, index in tokenizer.get_vocab().items()}
    added = tokenizer.get_added_vocab()
    tokens = [reverse.get(i, f'[PAD{i}]') for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED if i not in reverse else
             gguf.TokenType.CONTROL if reverse[i] in added else gguf.TokenType.NORMAL for i in range(vocab_size)]
    writer.add_tokenizer_model('gpt2')
    writer.add_tokenizer_pre('chatglm-bpe')
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True)
    for kind, token in (('eos', '<|endoftext|>'), ('eot', '<|user|>'), ('unk', '<|endoftext|>')):
        special._set_special_token(kind, added[token])
    special.add_to_gguf(writer)


def write_chatglm(hf: torch.nn.Module, folder: str, src: Path, own_layout: bool, qtype: Q) -> None:
    """ChatGLMModel's metadata and tensors; ``own_layout``: from GLM-4-9B-chat's own checkpoint (its
    ``seq_length``, ``layernorm_epsilon``, ``rope_ratio`` and fused ``query_key_value``)."""
    config = hf.config
    writer = gguf.GGUFWriter(str(src), 'chatglm')
    hidden, heads = config.hidden_size, config.num_attention_heads
    for add, value in [(writer.add_context_length, config.max_position_embeddings if own_layout else hidden),
                       (writer.add_embedding_length, hidden),
                       (writer.add_feed_forward_length, config.intermediate_size),
                       (writer.add_block_count, config.num_hidden_layers), (writer.add_head_count, heads),
                       (writer.add_head_count_kv, config.num_key_value_heads),
                       (writer.add_layer_norm_rms_eps, config.rms_norm_eps if own_layout else 1e-5),
                       (writer.add_rope_dimension_count, int(hidden // heads * 0.5)),
                       (writer.add_add_bos_token, False),
                       (writer.add_rope_freq_base, config.rope_parameters['rope_theta'] if own_layout else 10000)]:
        add(value)
    add_vocab(writer, folder, config.vocab_size)
    stored = round_trip(hf, qtype, np.random.default_rng(0))
    tensors = {name: stored.get(name, tensor.numpy()) for name, tensor in hf.state_dict().items()}
    if own_layout:  # query_key_value: q, k and v rows stacked, as the file keeps them
        for layer in range(config.num_hidden_layers):
            for kind in ('weight', 'bias'):
                parts = [tensors.pop(f'model.layers.{layer}.self_attn.{x}_proj.{kind}') for x in 'qkv']
                tensors[f'encoder.layers.{layer}.self_attention.query_key_value.{kind}'] = np.concatenate(parts)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.CHATGLM, config.num_hidden_layers)
    for name, data in tensors.items():
        raw = qtype if data.dtype == np.uint8 else None
        writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')), np.ascontiguousarray(data),
                          raw_dtype=raw)
    finish(writer)


@pytest.mark.parametrize('own_layout,qtype', [(False, Q.F32), (True, Q.F16), (True, Q.Q8_0), (False, Q.Q4_K)],
                         ids=['hf-F32', 'own-F16', 'own-Q8_0', 'hf-Q4_K'])
def test_chatglm_gguf_matches_transformers(own_layout: bool, qtype: Q, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    folder = save_glm(tmp_path / 'hf', own_layout, 'q4_k' if qtype == Q.Q4_K else 'small')
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    src = tmp_path / 'glm4.gguf'
    write_chatglm(hf, folder, src, own_layout, qtype)

    convert_gguf(str(src), str(tmp_path / 'converted'), raw_types=())  # every tensor dequantized
    converted = AutoModelForCausalLM.from_pretrained(str(tmp_path / 'converted'), dtype=torch.float32)
    assert converted.config.architectures == ['GlmForCausalLM']
    assert converted.config.eos_token_id == [hf.config.eos_token_id[0], hf.config.eos_token_id[1]]
    assert converted.config.rope_parameters == hf.config.rope_parameters
    assert converted.config.rms_norm_eps == pytest.approx(hf.config.rms_norm_eps)
    assert_same_state(converted, hf)

    if qtype in (Q.Q8_0, Q.Q4_K):  # the projections served as their blocks
        layer_types = make_engine(str(src)).model_config.hf_config.quantization_config['ggml_types']
        assert len(layer_types) == 4 * hf.config.num_hidden_layers and set(layer_types.values()) == {qtype.name}
    # a GlmForCausalLM's file states its hidden size as its context (ChatGLMModel reads ``seq_length`` only)
    vocab = hf.config.vocab_size
    assert_matches_transformers(str(src), hf, random_prompts([5, 24], vocab=vocab),
                                random_prompts([7, 30], seed=1, vocab=vocab))


def test_chatglm_gguf_tokenizer_encodes_as_original(tmp_path: Path) -> None:
    """GLM-4's split (Llama 3's: digits in threes, cased contractions, runs of newlines), special and end
    tokens and chat template, from the file's ``chatglm-bpe`` vocabulary."""
    folder = save_glm(tmp_path / 'hf', True, 'small')
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    write_chatglm(hf, folder, tmp_path / 'glm4.gguf', True, Q.F32)
    convert_gguf(str(tmp_path / 'glm4.gguf'), str(tmp_path / 'converted'))
    original = AutoTokenizer.from_pretrained(folder)
    converted = AutoTokenizer.from_pretrained(tmp_path / 'converted')
    for text in TEXTS:
        ids = converted(text)['input_ids']
        assert ids == original(text)['input_ids'], text
        assert converted.decode(ids) == text
    assert converted.eos_token == '<|endoftext|>' and not converted.add_bos_token
    messages = [{'role': 'user', 'content': 'what is 123456?'}]
    assert (converted.apply_chat_template(messages, add_generation_prompt=True, tokenize=True) ==
            original.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def test_chatglm3_sentencepiece_gguf_is_refused(tmp_path: Path) -> None:
    """ChatGLM2/3-6B files share the architecture but carry a SentencePiece vocabulary, not verified here."""
    src = tmp_path / 'chatglm3.gguf'
    writer = gguf.GGUFWriter(str(src), 'chatglm')
    for add, value in [(writer.add_embedding_length, 64), (writer.add_feed_forward_length, 128),
                       (writer.add_block_count, 1), (writer.add_head_count, 4), (writer.add_head_count_kv, 2)]:
        add(value)
    writer.add_tokenizer_model('llama')
    writer.add_tokenizer_pre('chatglm-spm')
    writer.add_token_list(['<unk>', '<bos>', '<eos>', 'a'])
    writer.add_tensor('token_embd.weight', np.zeros((4, 64), np.float32))
    finish(writer)
    with pytest.raises(ValueError, match='ChatGLM2/3'):
        convert_gguf(str(src), str(tmp_path / 'converted'))
    assert not (tmp_path / 'converted').exists()
