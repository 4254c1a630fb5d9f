"""The error type of torchspmd's argument checks."""


class SpmdError(ValueError, AssertionError):
    """A bad argument: a wrong mesh, partition spec, batch or wrapper order.

    It is a ``ValueError``, and also an ``AssertionError`` because torch_xla reports
    the same checks with ``assert``: code and tests written for torch_xla that catch
    either keep working. The message names the culprit and says how to fix it.
    """


class ShardingStateError(SpmdError, RuntimeError):
    """A call the tensor's sharding refuses where torch_xla raises ``RuntimeError`` (marking a
    tensor sharded over another mesh, which torch_xla refuses until ``clear_sharding``): also a
    ``RuntimeError``, so that code written for torch_xla catching it keeps working."""


class PeerLost(RuntimeError):
    """Another process this one waited for has ended, or stopped answering: a consequence
    of that process's failure (its own error says why), as a collective's lost connection."""
