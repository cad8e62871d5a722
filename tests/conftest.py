"""Shared fixtures: one loaded engine per backend for the whole session (loads are slow)."""
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHAT = [{"role": "user", "content": "Name three primary colors."}]


@pytest.fixture(scope="session")
def llamacpp_engine():
    from infercourse.engines.llamacpp import LlamaCppEngine
    return LlamaCppEngine(n_threads=1, n_ctx=2048)


@pytest.fixture(scope="session")
def transformers_engine():
    from infercourse.engines.transformers_engine import TransformersEngine
    return TransformersEngine(n_threads=1)


@pytest.fixture(scope="session")
def mlx_engine():
    from infercourse.core.errors import BackendMissingError
    from infercourse.engines.mlx_engine import MLXEngine
    try:
        return MLXEngine()
    except BackendMissingError as e:
        pytest.skip(f"MLX cannot run here: {e}")
