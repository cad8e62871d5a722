"""MLX-LM's own OpenAI-compatible server, `mlx_lm.server`."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from typing import Any, Sequence

from infercourse.core.errors import BackendMissingError, ModelLayerError
from infercourse.servers.process import Server

__all__ = ["MLXServer"]


class MLXServer(Server):
    """MLX-LM's `python -m mlx_lm.server` (Metal on a Mac, MLX's CPU backend on Linux).

    Its /v1/models answered with an empty body here (it scans the HF cache), so we
    health-check `/health` and name the model "default_model", its alias for --model.
    It has no API-key option, so it cannot be a room's shared server: it stays on 127.0.0.1.

    Args:
        model_folder: an MLX model folder (from `mlx_lm.convert`).
    """

    name = "mlx_lm.server"
    served_model = "default_model"

    def __init__(self, model_folder: str | Path, extra_args: Sequence[str] = (), **kw: Any):
        if importlib.util.find_spec("mlx_lm") is None:
            raise BackendMissingError("mlx-lm is not installed", hint="pip install 'infercourse[mlx]'")
        self.model_folder = Path(model_folder)
        if not (self.model_folder / "config.json").is_file():
            raise ModelLayerError(f"{self.model_folder} is not an MLX model folder (no config.json)")
        self.extra_args = list(extra_args)
        super().__init__(**kw)

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "mlx_lm.server", "--model", str(self.model_folder),
                *self.listen_args(), *self.extra_args]

    def version(self) -> str | None:
        return "mlx-lm " + importlib.metadata.version("mlx-lm")
