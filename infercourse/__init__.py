"""infercourse: live, measured experiments on real LLM inference engines.

Import is cheap: engines import their backends (llama.cpp, torch, MLX, httpx) lazily,
so `import infercourse` works where MLX or torch is absent.
"""
from .engines.base import Completion, Event, Request, Usage, generate
from .errors import InferCourseError
from .models import embedded_gguf, resolve_model

__version__ = "0.1.0"
__all__ = ["Completion", "Event", "Request", "Usage", "generate", "InferCourseError",
           "embedded_gguf", "resolve_model", "__version__"]
