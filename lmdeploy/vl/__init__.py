"""Turning (possibly multi-modal) prompts into model inputs."""
from lmdeploy.vl.processor import MultiModalProcessor

__all__ = ['MultiModalProcessor']
