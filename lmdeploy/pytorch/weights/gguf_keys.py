"""A GGUF file's metadata, and the fields of the transformers config that several GGUF architectures read alike
from it (gguf-py's ``Keys``): the sliding-window layers and the rotary of the file's keys."""
from __future__ import annotations

from typing import Any, Callable

from gguf import GGUFReader, Keys

Meta = Callable[..., Any]  # (a gguf-py ``Keys`` template, default) -> that key of the file's architecture


def metadata(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """The value of the file's metadata ``key`` (a full name), ``default`` where the file lacks it."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def required(meta: Meta, *templates: str) -> list[Any]:
    """The values of the keys ``templates``; a ``ValueError`` naming those the file lacks."""
    values = [meta(template) for template in templates]
    missing = [template.replace('{arch}.', '') for template, value in zip(templates, values) if value is None]
    if missing:
        raise ValueError(f'missing GGUF metadata: {", ".join(missing)}')
    return values


def layer_types(meta: Meta, layers: int, pattern: int) -> list[str]:
    """llama.cpp's sliding-window layers: the file's ``sliding_window_pattern`` (a step n, where the last
    layer of every n is global, or a flag per layer), else the architecture's fixed step."""
    value = meta(Keys.Attention.SLIDING_WINDOW_PATTERN, pattern)
    sliding = [bool(v) for v in value] if isinstance(value, list) else [i % value < value - 1 for i in range(layers)]
    return ['sliding_attention' if s else 'full_attention' for s in sliding]


def _yarn(meta: Meta, theta: float) -> dict[str, Any]:
    params = {'rope_type': 'yarn', 'rope_theta': theta, 'factor': meta(Keys.Rope.SCALING_FACTOR),
              'original_max_position_embeddings': meta(Keys.Rope.SCALING_ORIG_CTX_LEN),
              'beta_fast': meta(Keys.Rope.SCALING_YARN_BETA_FAST, 32.0),
              'beta_slow': meta(Keys.Rope.SCALING_YARN_BETA_SLOW, 1.0)}
    if meta(Keys.Rope.SCALING_YARN_ATTN_FACTOR) is not None:
        params['attention_factor'] = meta(Keys.Rope.SCALING_YARN_ATTN_FACTOR)
    return params


def rope_parameters(meta: Meta, theta: float) -> dict[str, Any]:
    """The rotary of the file's ``rope.scaling.type``: none, linear or YaRN."""
    kind = meta(Keys.Rope.SCALING_TYPE, 'none')
    if kind == 'yarn':
        return _yarn(meta, theta)
    if kind == 'linear':
        return {'rope_type': 'linear', 'rope_theta': theta, 'factor': meta(Keys.Rope.SCALING_FACTOR)}
    if kind != 'none':
        raise ValueError(f'unsupported GGUF rope scaling type {kind!r}')
    return {'rope_type': 'default', 'rope_theta': theta}


def glm_rope(meta: Meta, config: dict[str, Any]) -> dict[str, Any]:
    """GLM's rotary over the first ``rope.dimension_count`` features of each head (half where absent)."""
    rotary = meta(Keys.Rope.DIMENSION_COUNT) or config['head_dim'] // 2
    return {'rope_type': 'default', 'rope_theta': config['rope_theta'],
            'partial_rotary_factor': rotary / config['head_dim']}
