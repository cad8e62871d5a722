"""infercourse: live, measured experiments on real LLM inference engines.

The face a notebook needs, small on purpose; everything else is one import away in its
layer (see the README's table):

    import infercourse as ic
    engine = ic.make_engine("llamacpp", n_threads=1)       # embedded model, in process
    done = ic.generate(engine, "Why is the sky blue?")      # a fold over engine.stream()
    trace = ic.record(engine, ic.Request(prompt="Hi", max_tokens=8))   # timed, for metrics

Import is cheap: engines import their backends (llama.cpp, torch, MLX, httpx) lazily,
so `import infercourse` works where MLX or torch is absent.
"""
from infercourse.core.errors import InferCourseError
from infercourse.core.trace import RequestTrace, record
from infercourse.core.types import Completion, Event, Request, Usage, generate
from infercourse.engines import make_engine
from infercourse.models.embedded import embedded_gguf, resolve_model

__version__ = "0.1.0"
__all__ = ["Completion", "Event", "Request", "Usage", "generate", "record", "RequestTrace", "make_engine",
           "InferCourseError", "embedded_gguf", "resolve_model", "__version__"]
