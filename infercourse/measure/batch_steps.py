"""Decode steps of N sequences at once, timed, in llama.cpp's C API: what a batch costs.

A serving engine decodes many sequences together: one forward pass (`llama_decode`) takes one
new token from each sequence in the batch and reads the weights once for all of them. To
measure what a step of N costs, `Stepper` holds one GGUF and one context with room for several
sequences, prefills a prompt in each, then decodes the chosen sequences together, greedy and
forced to length (no end-of-text stop), timing every `llama_decode` from the call to
`llama_synchronize`. Those seconds are the step times; sampling (an argmax over the logits) is
outside the timer. No HTTP, no scheduler: the step alone.

`observe="<tensor name prefix>"` also reads chosen intermediate tensors of every step through
llama.cpp's eval callback, e.g. "ffn_moe_argsort-" for the experts a mixture-of-experts router
ranked per token and layer (`lessons.moe`). Each read is a sync point, so never time an
observed run.
"""
from __future__ import annotations

import ctypes
import time
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from infercourse.compat import ggml_lib

__all__ = ["Stepper"]


class Stepper:
    """One GGUF in llama.cpp's C API, with `n_seq` sequences in one context: `prefill` puts a
    prompt in each, `steps` decodes the given sequences together, one token each per
    `llama_decode`, greedy and forced (no end-of-text stop), timing each call.

    Args:
        path: a GGUF; n_seq: sequences the context holds; n_ctx_seq: tokens per sequence.
        n_threads: llama.cpp threads; n_batch: the most tokens one `prefill` may hold.
        observe: a tensor name prefix: after every step, `self.observed` gets a list of
            (layer, int32 data) of the tensors named `<prefix><layer>`, in layer order (e.g.
            "ffn_moe_argsort-": each token's experts ranked, E per token); None: none.
    """

    def __init__(self, path: str | Path, n_seq: int, n_ctx_seq: int = 256, *, n_threads: int = 1,
                 n_batch: int = 512, observe: str | None = None):
        import llama_cpp as lc

        from infercourse.core.errors import ModelLayerError
        self.lc, self.n_seq, self.n_batch, self.observed, self._seen = lc, n_seq, n_batch, [], []
        self._prefix, self._closed = observe, False
        self._cb = lc.ggml_backend_sched_eval_callback(self._observe) if observe else None
        self._g = ggml_lib() if observe else None
        # llama.cpp logs the load to sys.stderr: callers redirect it (lessons.moe: the native log)
        self.model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
        if not self.model:
            raise ModelLayerError(f"llama.cpp could not load {path}")
        cp = lc.llama_context_default_params()
        cp.n_ctx, cp.n_seq_max = n_seq * n_ctx_seq, n_seq
        cp.n_batch = cp.n_ubatch = n_batch
        cp.n_threads = cp.n_threads_batch = n_threads
        if self._cb is not None:
            cp.cb_eval, cp.cb_eval_user_data = self._cb, None
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise ModelLayerError(f"llama.cpp could not make a context of {n_seq} sequences for {path}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(cp.n_batch, 0, 1)
        self.pos: dict[int, int] = {}     # next position of each sequence
        self.next: dict[int, int] = {}    # its next token (greedy)

    def _observe(self, t, ask, _user) -> bool:
        name = self._g.ggml_get_name(t).decode()
        if not name.startswith(self._prefix):
            return not ask            # ask: not wanted; after compute: go on
        if not ask:
            n = self._g.ggml_nelements(t)
            data = ctypes.cast(self._g.ggml_get_data(t), ctypes.POINTER(ctypes.c_int32))
            tail = name[len(self._prefix):]
            self._seen.append((int(tail) if tail.isdigit() else -1, np.ctypeslib.as_array(data, shape=(n,)).copy()))
        return True

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> float:
        lc, b = self.lc, self.batch
        b.n_tokens = len(items)
        for i, (tok, pos, seq, want) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, want
            b.seq_id[i][0] = seq
        self._seen.clear()
        t0 = time.perf_counter()
        rc = lc.llama_decode(self.ctx, b)
        lc.llama_synchronize(self.ctx)
        dt = time.perf_counter() - t0
        if rc != 0:
            from infercourse.core.errors import RuntimeLayerError
            raise RuntimeLayerError(f"llama_decode returned {rc} for a batch of {len(items)} tokens")
        wanted = [(i, seq) for i, (_, _, seq, want) in enumerate(items) if want]
        for i, seq in wanted:
            logits = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
            self.next[seq] = int(np.argmax(logits))
        return dt

    def prefill(self, prompts: Mapping[int, Sequence[int]]) -> float:
        """Put prompt token ids in sequences ({seq id: ids}), in one batch; returns its seconds."""
        items = [(tok, p, s, p == len(ids) - 1) for s, ids in prompts.items() for p, tok in enumerate(ids)]
        if len(items) > self.n_batch:
            raise ValueError(f"{len(items)} prompt tokens exceed n_batch={self.n_batch}: prefill fewer at a time")
        dt = self._decode(items)
        self.pos.update({s: len(ids) for s, ids in prompts.items()})
        return dt

    def steps(self, seqs: Sequence[int], n_steps: int) -> list[float]:
        """Decode `n_steps` tokens in each of `seqs` together; the seconds of every step."""
        out = []
        for _ in range(n_steps):
            out.append(self._decode([(self.next[s], self.pos[s], s, True) for s in seqs]))
            for s in seqs:
                self.pos[s] += 1
            if self._cb is not None:
                self.observed.append(sorted(self._seen, key=lambda x: x[0]))
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed, lc = True, self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def __enter__(self) -> "Stepper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


