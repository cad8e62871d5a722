"""How `infercourse bench` builds its workload from the command line: the prompts, counted
with the tokenizer of the model that answers (--tokenizer, the in-process engine's own, or the
server's /tokenize), never silently with another model's."""
from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["build_workload", "file_tokenizer"]


def file_tokenizer(path: Path):
    """A tokenizer from a file: a .gguf (llama.cpp, vocabulary only) or an HF tokenizer
    (a folder holding tokenizer.json, or the file itself)."""
    if path.suffix == ".gguf":
        from infercourse.models.embedded import vocab_tokenizer
        return vocab_tokenizer(path)
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        from infercourse.core.errors import BackendMissingError
        raise BackendMissingError("reading an HF tokenizer needs the `tokenizers` package",
                                  hint="pip install 'infercourse[hf]', or give a .gguf") from e
    tok = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
    return lambda text: tok.encode(text).ids


def _tokenizer(a: argparse.Namespace, engine):
    """Count with the model that answers: --tokenizer, else the in-process engine's own,
    else the server's /tokenize; never silently with another model's."""
    from infercourse.measure.workloads import local_tokenizer
    if a.tokenizer is not None:
        return file_tokenizer(a.tokenizer)
    if hasattr(engine, "server_tokenizer"):
        return engine.server_tokenizer()
    return local_tokenizer(engine)


def build_workload(a: argparse.Namespace, engine, salt: str | None):
    from infercourse.measure import workloads as wl
    from infercourse.core.types import Request
    from infercourse.cli.load import dataset_workload
    if a.sessions or a.session_counts or a.dataset is not None:   # built by cli.load
        return dataset_workload(a)
    if a.workload == "agentic":
        return wl.agentic_workload()
    if a.workload == "coding-agent":   # one session, rendered for the API being measured
        from infercourse.measure.agent_workload import coding_agent_session
        return coding_agent_session(api="anthropic" if a.api == "anthropic" else "openai",
                                    n_calls=a.requests)
    if a.workload.startswith("shared-prefix"):
        variant = {"shared-prefix": "shared", "shared-prefix-timestamp": "timestamp",
                   "shared-prefix-reordered": "reordered_tools"}[a.workload]
        return wl.shared_prefix_workload(min(a.requests or 16, 64), variant=variant,
                                         max_tokens=a.max_tokens, seed=a.seed)
    tok, n = _tokenizer(a, engine), min(a.requests or 8, 64)   # distinct prompts: no cache reuse
    # the salt is part of the prompt, so it counts towards --prompt-tokens
    lead = "" if salt is None else f"{salt}\n"
    reqs = tuple(Request(prompt=wl.exact_length_prompt(a.prompt_tokens, lambda t: tok(lead + t), seed=a.seed + i),
                         max_tokens=a.max_tokens, seed=a.seed) for i in range(n))
    return wl.Workload(f"fixed-{a.prompt_tokens}tok", reqs)
