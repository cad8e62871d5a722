"""Keep the Python libraries' chatter out of notebook cells.

Native code (llama.cpp, ggml, torch's C++) writes to file descriptors 1 and 2, and
`ops.logs.native_logs_to_file` sends those to a log file. Some Python libraries write
*above* the descriptors, to Python's `sys.stderr` object, which a notebook shows in the
cell: torchao's CUDA-only extensions failing to load on a CPU, torch's pytree deprecation
notes, bitsandbytes' missing optional kernel, transformers' warnings and its "Loading
weights" progress bar (a tqdm bar that an executed notebook keeps frozen at its first
frame, e.g. "0/272"). `quiet()` turns those off or routes them to the log file, once per
process, before the libraries are imported.
"""
from __future__ import annotations

__all__ = ["CHATTY_LOGGERS", "quiet"]

# Python loggers that write to `sys.stderr` on import (CUDA-only torchao extensions that fail
# to load on a CPU, torch's pytree deprecation notes, a missing optional bitsandbytes kernel);
# `ops.logs.native_logs_to_file` sends them to its log file too
CHATTY_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes")


def quiet() -> None:
    """Keep these libraries' chatter out of notebook cells (it reaches Python's stderr
    object, above the descriptors `native_logs_to_file` redirects): CUDA-only extensions
    that fail to load on import, an optional CPU kernel package, deprecation notes, progress
    bars, and one warning per layer per forward pass. Call it before they are imported."""
    import importlib.util
    import logging
    import warnings
    for name in CHATTY_LOGGERS:   # before their import
        logging.getLogger(name).setLevel(logging.ERROR)
    if importlib.util.find_spec("transformers"):
        import transformers
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()   # "Loading weights" bars, one per load
    # LLM.int8 on CPU casts float32 activations to float16 for its int8 matmul: true, and
    # said once in the module docstring rather than 30 times a token
    warnings.filterwarnings("ignore", message="MatMul8bitLt: inputs will be cast")
