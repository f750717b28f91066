"""Exception types raised by bastion."""

from __future__ import annotations


class BastionError(Exception):
    """Base class of every error bastion raises on purpose."""


class InvalidInputError(BastionError, ValueError):
    """A caller passed a value bastion cannot work with (shapes, ranges, NaN...)."""


class TreeValidationError(BastionError, ValueError):
    """A tree breaks one of the structural invariants every tree must keep."""


class IncompatibleComponentsError(BastionError, ValueError):
    """Two components cannot work together (vocab sizes, hidden sizes, layer counts...)."""


class UnknownComponentError(BastionError, KeyError):
    """No component of that kind is registered under that name."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class DuplicateComponentError(BastionError, ValueError):
    """Two sources registered the same (kind, name)."""


class PluginLoadError(BastionError, RuntimeError):
    """A third-party plugin failed to import or to register its components."""


class InvalidFileError(InvalidInputError):
    """A file bastion reads is truncated, garbled, wrongly typed, unsafe or points outside its folder.
    The message names the file and, where one is at fault, the field."""


class CheckpointMismatchError(InvalidFileError, IncompatibleComponentsError):
    """A checkpoint's weights disagree with its own config (a missing, unexpected or wrongly shaped
    tensor, a layer count the weights do not hold). The message names the checkpoint and the tensors."""


class InvalidOptionError(InvalidInputError, TypeError):
    """A component was created with an option it does not take (a typo in ``registry.create(...)``)."""


class FileSystemError(BastionError, OSError):
    """A file or folder bastion must read or write cannot be: missing, a directory, read-only, a full
    disk, held by another process... The message names the path and the cause."""


class InvalidRowsError(InvalidInputError):
    """Lines of an input file cannot be decoded; ``errors`` holds one description per line, in order."""

    def __init__(self, summary: str, errors: "list[str] | tuple[str, ...]") -> None:
        self.errors = tuple(errors)
        super().__init__("\n  ".join([summary, *self.errors]))


class ComponentError(BastionError, RuntimeError):
    """A component broke its interface contract at run time: a wrong return type, a verdict that is not
    a root path of the tree, a NaN or non-positive latency prediction... The message names the component."""
