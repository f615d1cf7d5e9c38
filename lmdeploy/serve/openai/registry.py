"""Classes registered by name: how the server's pluggable parsers are found from their flags."""
from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar('T')


class Registry(dict[str, type[T]], Generic[T]):
    """Names to classes; ``kind`` names what they are in errors."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, *names: str) -> Callable[[type[T]], type[T]]:
        """Class decorator: makes the class available under ``names``."""
        def register(cls: type[T]) -> type[T]:
            for name in names:
                self[name] = cls
            return cls
        return register

    def lookup(self, name: str) -> type[T]:
        """The class registered as ``name``; ``ValueError`` names the known ones otherwise."""
        if name not in self:
            raise ValueError(f'unknown {self.kind} {name!r}; known: {", ".join(sorted(self))}')
        return self[name]
