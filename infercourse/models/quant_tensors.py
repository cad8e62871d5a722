"""What a loaded (quantized) model holds in memory, and how a saved state goes back in.

A quantized tensor is more than its integers: bitsandbytes keeps per-block absmax values
and a code book beside NF4 weights and one scale per row beside int8 ones; torchao's
tensor subclasses hold packed data, scales and zero points as inner tensors. `weight_bytes`
counts all of it, the tied embedding once, which is what a decode step can read. torchao
formats are saved as a state dict of those subclasses; `load_state` puts one back into a
model built from the float folder and refuses any key that does not fit.
"""
from __future__ import annotations

from infercourse.core.errors import ModelLayerError

__all__ = ["TIED", "load_state", "weight_bytes"]


# the one key a saved state may lack: the output layer tied to the embedding (tie_weights
# restores it); any other gap means the file and the model disagree
TIED = ("lm_head.weight",)


def load_state(model, state: dict, where="the state dict") -> None:
    """`model.load_state_dict(state, assign=True)`, refusing any missing or unexpected key
    but the tied output layer; raises ModelLayerError naming the keys."""
    res = model.load_state_dict(state, assign=True, strict=False)
    tied = set(TIED) if getattr(getattr(model, "config", None), "tie_word_embeddings", False) else set()
    missing, unexpected = sorted(set(res.missing_keys) - tied), sorted(res.unexpected_keys)
    if missing or unexpected:
        raise ModelLayerError(f"{where} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
                              f" ({len(missing)} missing, {len(unexpected)} unexpected)",
                              hint="delete the derived folder and derive it again")


def weight_bytes(model) -> int:
    """Bytes the model's parameters and buffers hold as loaded (quantized tensors report
    their packed data, scales and zero points), the tied embedding counted once."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        try:   # a tied embedding may come back as two Parameters over one storage
            key = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):   # tensor subclasses have none
            key = id(t)
        if key in seen:
            continue
        seen.add(key)
        total += _tensor_bytes(t)
    return total


def _tensor_bytes(t) -> int:
    inner = getattr(t, "__tensor_flatten__", None)
    if inner is not None and type(t).__name__ not in ("Parameter", "Tensor"):
        names, _ = inner()
        return sum(_tensor_bytes(getattr(t, n)) for n in names if getattr(t, n, None) is not None)
    extra = 0
    state = getattr(t, "quant_state", None)   # bitsandbytes 4-bit: absmax and code book
    if state is not None:
        extra = sum(x.numel() * x.element_size() for x in (state.absmax, state.code))
    scb = getattr(t, "SCB", None)             # bitsandbytes int8: one scale per row
    if scb is not None:
        extra += scb.numel() * scb.element_size()
    return t.numel() * t.element_size() + extra
