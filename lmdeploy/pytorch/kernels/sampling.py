"""Greedy decoding's choice of token."""
import torch


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value ``[...]`` from ``logits [..., V]``; the first one on ties."""
    return logits.argmax(-1)
