"""The slot ring's one error type, in a module of its own so that common.ring and its CUDA backend
(common.ring_cuda) both use it without importing each other in a circle."""


class RingError(RuntimeError):
    """The ring cannot be created, attached or used as asked; the message says why."""
