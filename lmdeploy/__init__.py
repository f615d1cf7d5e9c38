"""lmdeploy: serve large language models with an in-tree PyTorch engine."""
from lmdeploy.api import pipeline
from lmdeploy.messages import GenerationConfig, PytorchEngineConfig, Response
from lmdeploy.pipeline import Pipeline

__version__ = '0.1.0'
__all__ = ['GenerationConfig', 'Pipeline', 'PytorchEngineConfig', 'Response', 'pipeline']
