"""kvchat's engine: a block-paged KV cache and generation on MLX.

Importing this package first preloads OpenBLAS on Linux (see `engine.model.blas`),
which must happen before anything imports `mlx.core`. The preload compiles nothing; it
loads the GEMV shim when an earlier model load left one built in the user cache.
"""

from engine.model import blas, fd_limits

blas.preload()
fd_limits.import_mlx_lm()  # before anything else imports it (see `engine.model.fd_limits`)

from engine.config import EngineConfig  # noqa: E402
from engine.constraint import Constraint  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.errors import KVChatError, ModelLoadError, RequestError  # noqa: E402
from engine.model.loader import LoadedModel, load_model  # noqa: E402
from engine.request import Priority  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

__all__ = [
    "Constraint",
    "Engine",
    "EngineConfig",
    "KVChatError",
    "LoadedModel",
    "ModelLoadError",
    "Priority",
    "RequestError",
    "SamplingParams",
    "load_model",
]
