"""Getting models in: inspect, acquire, convert, register, with manifests.

Built on ``mlxd.sources`` (resolution, staging, manifests); ``qualify`` lives
above the server in ``mlxd.qualify``, since it starts one.
"""

from mlxd.sources.refs import SourceError as WorkflowError

__all__ = ["WorkflowError"]
