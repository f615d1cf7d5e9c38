"""lmdeploy: serve large language models with an in-tree PyTorch engine."""
from lmdeploy.api import client, pipeline, serve
from lmdeploy.messages import ChatTemplateConfig, GenerationConfig, PytorchEngineConfig, Response
from lmdeploy.pipeline import Pipeline

__version__ = '0.1.0'
__all__ = ['ChatTemplateConfig', 'GenerationConfig', 'Pipeline', 'PytorchEngineConfig', 'Response', 'client',
           'pipeline', 'serve']
