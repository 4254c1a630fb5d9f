"""The error type of torchspmd's argument checks."""


class SpmdError(ValueError, AssertionError):
    """A bad argument: a wrong mesh, partition spec, batch or wrapper order.

    It is a ``ValueError``, and also an ``AssertionError`` because torch_xla reports
    the same checks with ``assert``: code and tests written for torch_xla that catch
    either keep working. The message names the culprit and says how to fix it.
    """
