"""A mixture-of-experts model, derived from the embedded one: what "30B-A3B" means, in a file.

A dense transformer block sends every token through one feed-forward network (FFN). A
mixture-of-experts (MoE) block holds E FFNs, the *experts*, and a *router*: one E × hidden
matrix that scores the experts for each token. The token goes through the k best only, and
their outputs are summed, weighted by the router's softmax renormalized over those k. So a
token is *active* in k of E experts: the file and the memory hold all E (a 30B-A3B model keeps
30 B parameters resident) while a decoded token reads only the shared weights and k experts
(~3 B), and decode, which is bound by the bytes it reads, runs at the speed of the active part.

We make one by *upcycling* (Mixtral's recipe, "sparse upcycling"): every expert is a copy of
the dense model's FFN. Identical experts make the output the dense model's:
sum_i w_i FFN(x) = FFN(x) × sum_i w_i = FFN(x), because the k weights sum to 1. Both runtimes
renormalize them: llama.cpp's llama architecture calls `build_moe_ffn` with softmax gating over
all E and `norm_w = true` (the top-k weights divided by their sum; src/models/llama.cpp,
src/llama-graph.cpp), and transformers' `MixtralTopKRouter` divides by the sum too. The router
is random (seeded), not zero, so different tokens pick different experts (what batching acts
on) while the output stays the dense one. In floats: bit for bit at k = 1 (the one weight is
p/p = 1); at k = 2 the weights sum to 1 only to the last bit, and llama.cpp, which rounds
activations to 8 bits before every Q4_1 product, can grow that into logit differences as large
as the dense model shows between evaluating a prompt in one batch or token by token
(tests/test_moe.py measures both).

`wide_gguf` makes the other yardstick, a *dense* model with E× the FFN and the same output:
gate and up tiled E times along the intermediate dimension, down tiled and divided by E, so
sum_e (down/E)·h = down·h. It holds the MoE's total bytes and reads all of them per token.

How the GGUFs are built: from the dense GGUF that llama.cpp's quantizer made
(`formats.quantized_gguf`), by copying its quantized bytes. A quantized tensor is rows of
independent blocks, so an expert stack (a 3-D tensor, E × rows) is the dense rows repeated, bit
for bit, and the wide down projection is each row's blocks repeated with their fp16 scales (and
minimums) divided by E (exact for a power of two, bar fp16 subnormals: counted in the manifest).
We do not run the quantizer on the MoE itself: for an 8-expert model llama.cpp's quantizer
(src/llama-quant.cpp) bumps attn_k and attn_v to Q8_0 ("for the 8-expert model, bumping this to
Q8_0 trades just ~128MB"), which would change the attention and the sizes being compared. So
every non-FFN tensor is the dense file's own, and the files differ by the FFN alone. The router
is F32 (the quantizer never quantizes `ffn_gate_inp` either).

The same MoE in the Hugging Face format: `models.moe_hf`.

Note the cost of full-size experts: active = shared + k × FFN, so this MoE reads *more* per
token than the dense model it came from (k = 2: one FFN more). Real MoEs make experts small so
that k of them cost about one dense FFN (Qwen3-30B-A3B: 128 experts of width 768, 8 used).
"""
from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable

import numpy as np

from infercourse.core.errors import ModelLayerError
from infercourse.models.derive import derive, derived_dir
from infercourse.models.gguf_header import read_header

__all__ = ["dense_gguf", "moe_gguf", "wide_gguf", "router_weights", "weight_split", "SCALABLE"]

_FFN = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.weight$")
# quantized types whose blocks start with fp16 scale fields: (bytes per block, leading fp16 fields);
# a value is d*q (+ m), so dividing d (and m) by E divides every weight of the block by E
SCALABLE = {"Q4_0": (18, 1), "Q4_1": (20, 2), "Q5_0": (22, 1), "Q5_1": (24, 2), "Q8_0": (34, 1)}


def dense_gguf(qtype: str = "Q4_1", source: str | Path | None = None) -> Path:
    """The dense GGUF the MoE and the wide model are copied from: llama.cpp's quantizer's
    output for `qtype` (or the F16 GGUF for "F16"), so the three compare like for like.

    Args:
        qtype: a llama.cpp file type ("Q4_1", "Q8_0", "F16"...).
        source: a GGUF file; None for the embedded model.
    """
    from infercourse.models.formats import f16_gguf, quantized_gguf
    return f16_gguf(source) if qtype.upper() == "F16" else quantized_gguf(qtype, source)


def router_weights(n_layers: int, n_expert: int, n_embd: int, seed: int = 0) -> np.ndarray:
    """The routers: (n_layers, n_expert, n_embd) float32, N(0, 1/n_embd), seeded. Row e of layer
    l scores expert e; the GGUF and the HF folder get the same matrices for the same seed.

    Args:
        n_layers, n_expert, n_embd: shape; seed: numpy generator seed.
    """
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n_layers, n_expert, n_embd)) / np.sqrt(n_embd)).astype(np.float32)


def _stem(dense: Path) -> str:
    return dense.name.removesuffix(".gguf")


def _rewrite(src: Path, dst: Path, kv: dict[str, tuple[Any, Any]],
             tensor_plan: Callable[[Any], list[tuple[str, tuple, Any, int, Any, Callable[[], np.ndarray]]]]) -> None:
    """Copy GGUF `src` to `dst`: every key (those in `kv` replaced or added) and every tensor as
    `tensor_plan(tensor)` says: a list of (name, shape, dtype, nbytes, ggml type, make array).
    Streamed: one output tensor in memory at a time. gguf-py's reader, not `gguf_header`'s: every
    field is copied, so the vocabulary must be decoded anyway."""
    import gguf
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
    for f in r.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF.") or f.name in kv:
            continue
        vt = f.types[0]
        w.add_key_value(f.name, f.contents(), vt,
                        sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    for key, (val, vt) in kv.items():
        w.add_key_value(key, val, vt)
    plan = [p for t in r.tensors for p in tensor_plan(t)]
    for name, shape, dtype, nbytes, qt, _ in plan:
        w.add_tensor_info(name, shape, dtype, nbytes, qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for *_, make in plan:
        w.write_tensor_data(np.ascontiguousarray(make()))
    w.close()


def _same(t) -> list:
    return [(t.name, tuple(t.data.shape), t.data.dtype, t.data.nbytes, t.tensor_type, lambda: t.data)]


def _hparams(src: Path) -> dict[str, int]:
    kv, _ = read_header(src)
    arch = kv["general.architecture"]
    if arch != "llama":
        raise ModelLayerError(f"{src.name} is a {arch!r} model; upcycling here handles the llama architecture")
    if f"{arch}.expert_count" in kv:
        raise ModelLayerError(f"{src.name} is already a mixture of experts")
    return {"n_layers": kv["llama.block_count"], "n_embd": kv["llama.embedding_length"],
            "n_ff": kv["llama.feed_forward_length"]}


def moe_gguf(n_expert: int = 8, n_used: int = 2, qtype: str = "Q4_1", *, seed: int = 0,
             source: str | Path | None = None) -> Path:
    """The upcycled MoE GGUF: every layer's FFN copied into `n_expert` experts
    (`blk.N.ffn_{gate,up,down}_exps.weight`, shapes {hidden, ff, E} and {ff, hidden, E} as
    convert_hf_to_gguf.py writes Mixtral), a random F32 router `blk.N.ffn_gate_inp.weight`, and
    `llama.expert_count` / `llama.expert_used_count`. Derived once (see module docstring).

    Args:
        n_expert: experts per layer (E); n_used: experts each token goes through (k).
        qtype: the dense file's type, copied bit for bit (`dense_gguf`).
        seed: the routers' seed (`router_weights`).
        source: a GGUF file; None for the embedded model.
    """
    import gguf
    if not 1 <= n_used <= n_expert:
        raise ValueError(f"need 1 <= n_used <= n_expert, got k={n_used}, E={n_expert}")
    dense = dense_gguf(qtype, source)
    name = f"{_stem(dense)}.moe-{n_expert}x-top{n_used}.gguf"
    routers: list[np.ndarray] = []     # filled when built: a cached file reads nothing

    def plan(t) -> list:
        m = _FFN.match(t.name)
        if not m:
            return _same(t)
        layer, which = int(m.group(1)), m.group(2)
        stacked = (f"blk.{layer}.ffn_{which}_exps.weight", (n_expert, *t.data.shape), t.data.dtype,
                   n_expert * t.data.nbytes, t.tensor_type,
                   lambda: np.broadcast_to(t.data, (n_expert, *t.data.shape)))
        out = [stacked]
        if which == "gate":     # one router per layer, written beside the gate experts
            r = routers[layer]
            out.insert(0, (f"blk.{layer}.ffn_gate_inp.weight", r.shape, r.dtype, r.nbytes,
                           gguf.GGMLQuantizationType.F32, lambda: r))
        return out

    def build(out: Path) -> dict:
        hp = _hparams(dense)
        routers.extend(router_weights(hp["n_layers"], n_expert, hp["n_embd"], seed))
        kv = {"llama.expert_count": (n_expert, gguf.GGUFValueType.UINT32),
              "llama.expert_used_count": (n_used, gguf.GGUFValueType.UINT32),
              "general.name": (f"SmolLM2-135M-Instruct upcycled {n_expert} experts, top-{n_used}",
                               gguf.GGUFValueType.STRING)}
        _rewrite(dense, out / name, kv, plan)
        return {"tool": "infercourse.models.moe.moe_gguf", "version": version("gguf"),
                "args": {"n_expert": n_expert, "n_used": n_used, "qtype": qtype.upper(), "seed": seed,
                         "router": "N(0, 1/n_embd) float32", "experts": "copies of the dense FFN, bit for bit",
                         "dense": dense.name}}

    return derive(derived_dir(source) / f"gguf-{qtype.upper()}-moe{n_expert}x{n_used}-s{seed}", build,
                  source=dense) / name


def _divide_blocks(data: np.ndarray, qtype: str, factor: int) -> tuple[np.ndarray, int]:
    """A copy of `data` (rows of blocks, or plain floats) with every weight divided by `factor`:
    the fp16 scale fields of each block divided. Returns (array, fields not exactly divisible)."""
    if data.dtype in (np.float16, np.float32):
        out = data / data.dtype.type(factor)
        return out.astype(data.dtype), int(np.count_nonzero(out.astype(data.dtype) * factor != data))
    if qtype not in SCALABLE:
        raise ModelLayerError(f"cannot divide {qtype} blocks by a factor here",
                              hint=f"use one of F16, F32, {', '.join(SCALABLE)}")
    size, fields = SCALABLE[qtype]
    blocks = np.array(data, copy=True).reshape(-1, size)
    head = blocks[:, :2 * fields].copy().view(np.float16)
    new = (head / np.float16(factor)).astype(np.float16)
    blocks[:, :2 * fields] = new.view(np.uint8)
    return blocks.reshape(data.shape), int(np.count_nonzero(new.astype(np.float32) * factor != head))


def wide_gguf(factor: int = 8, qtype: str = "Q4_1", *, source: str | Path | None = None) -> Path:
    """A dense GGUF with `factor`× the FFN width and the dense model's output (module
    docstring): ffn_gate and ffn_up tiled along the intermediate dimension, ffn_down tiled and
    divided by `factor`, `llama.feed_forward_length` multiplied.

    Args:
        factor: how many times the FFN (E, to match `moe_gguf`).
        qtype: the dense file's type: F16, F32 or one of `SCALABLE` (fp16 block scales).
        source: a GGUF file; None for the embedded model.
    """
    import gguf
    if factor < 1:
        raise ValueError(f"factor must be >= 1, got {factor}")
    dense = dense_gguf(qtype, source)
    name = f"{_stem(dense)}.ffn-x{factor}.gguf"
    inexact = [0]

    def plan(t) -> list:
        m = _FFN.match(t.name)
        if not m:
            return _same(t)
        d = t.data
        if m.group(2) != "down":       # rows are intermediate units: repeat the rows
            return [(t.name, (factor * d.shape[0], *d.shape[1:]), d.dtype, factor * d.nbytes, t.tensor_type,
                     lambda: np.tile(d, (factor, 1)))]

        def down() -> np.ndarray:      # each row runs over the intermediate units: repeat within rows
            arr, bad = _divide_blocks(np.tile(d, (1, factor)), t.tensor_type.name, factor)
            inexact[0] += bad
            return arr
        return [(t.name, (d.shape[0], factor * d.shape[1]), d.dtype, factor * d.nbytes, t.tensor_type, down)]

    def build(out: Path) -> dict:
        hp = _hparams(dense)
        kv = {"llama.feed_forward_length": (factor * hp["n_ff"], gguf.GGUFValueType.UINT32),
              "general.name": (f"SmolLM2-135M-Instruct with {factor}x the FFN", gguf.GGUFValueType.STRING)}
        _rewrite(dense, out / name, kv, plan)
        return {"tool": "infercourse.models.moe.wide_gguf", "version": version("gguf"),
                "args": {"factor": factor, "qtype": qtype.upper(), "dense": dense.name,
                         "ffn": "gate, up tiled; down tiled and divided by factor",
                         "inexact_scale_fields": inexact[0]}}

    return derive(derived_dir(source) / f"gguf-{qtype.upper()}-ffnx{factor}", build, source=dense) / name


def weight_split(path: str | Path) -> dict[str, Any]:
    """What a GGUF holds and what one decoded token reads, from its tensor table.

    Returns bytes and parameters of: `expert` tensors (ffn_*_exps), `router`s, and `shared`
    (everything else, a dense FFN included); n_expert and n_used (0 for a dense file); and
    total_* = all of them, active_* = shared + router + n_used/n_expert of the experts: what a
    single token's decode step reads (the embedding is read as the tied output head); and the
    shape the KV-cache arithmetic needs (n_layers, n_kv_heads, head_dim).

    Args:
        path: a GGUF file.
    """
    kv, tensors = read_header(path)
    arch = kv["general.architecture"]
    e = int(kv.get(f"{arch}.expert_count") or 0)
    k = int(kv.get(f"{arch}.expert_used_count") or 0) if e else 0
    out = {f"{g}_{u}": 0 for g in ("expert", "router", "shared") for u in ("bytes", "params")}
    for t in tensors:
        name = t["name"]
        g = "expert" if "_exps." in name else "router" if "ffn_gate_inp" in name else "shared"
        out[f"{g}_bytes"] += t["n_bytes"]
        out[f"{g}_params"] += t["n_elements"]
    get = lambda key, default=None: kv.get(f"{arch}.{key}", default)  # noqa: E731
    heads = int(get("attention.head_count"))
    shape = {"n_layers": int(get("block_count")), "n_kv_heads": int(get("attention.head_count_kv", heads)),
             "head_dim": int(get("attention.key_length", get("embedding_length") // heads))}
    share = k / e if e else 0.0
    for u in ("bytes", "params"):
        out[f"total_{u}"] = out[f"expert_{u}"] + out[f"router_{u}"] + out[f"shared_{u}"]
        out[f"active_{u}"] = out[f"shared_{u}"] + out[f"router_{u}"] + share * out[f"expert_{u}"]
    return {"file": Path(path).name, "file_bytes": Path(path).stat().st_size, "n_expert": e, "n_used": k,
            **out, **shape}
