"""One model, many formats: every format the course uses, derived locally from one GGUF.

The embedded SmolLM2-135M-Instruct Q4_1 GGUF is the single source. From it we derive, once,
into `cache_dir()/derived/<sha256 prefix of the source>/`:

    hf/            HF safetensors folder (transformers dequantizes the GGUF)      float32
    gguf-F16/      F16 GGUF (llama.cpp's convert_hf_to_gguf.py from hf/)
    gguf-<Q>/      re-quantized GGUFs (llama.cpp's quantizer, from the F16 GGUF)
    mlx/, mlx-q4/  MLX folders (mlx_lm.convert from hf/), float and 4-bit

Why float32 for hf/: a Q4_1 weight is d*q + m with fp16 d and m and a 4-bit q, and the
tied embedding is Q8_0 (d*q, 8-bit q); such products need up to ~19 significand bits, so
fp16 (11) and bf16 (8) would round them. float32 (24) holds them exactly (tested).

Every derivation goes through `models.derive`: built in a temporary sibling folder, with a
`manifest.json` of its conditions, renamed into place only when complete, under a file lock.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from importlib.metadata import version
from pathlib import Path

from infercourse.core.errors import BackendMissingError, ModelLayerError, RuntimeLayerError
from infercourse.models.derive import derive, derived_dir, manifest, source_gguf
from infercourse.models.embedded import cache_dir

__all__ = ["hf_folder", "f16_gguf", "quantized_gguf", "quant_ladder", "mlx_folder",
           "ensure_all", "derived_dir", "manifest", "LADDER"]

LADDER = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K")
_STEM = "SmolLM2-135M-Instruct"


def hf_folder(source: str | Path | None = None) -> Path:
    """HF safetensors folder (float32, see module docstring) dequantized from the GGUF.

    transformers reads the GGUF (weights, config, tokenizer); we then add `rope_theta` to
    config.json, because transformers 5 writes it only inside `rope_parameters` and
    mlx-lm, not finding it, silently falls back to 10000 (worse text, no error).

    Args:
        source: a GGUF file; None for the embedded model.
    """
    src = source_gguf(source)

    def build(out: Path) -> dict:
        try:
            import torch
            import transformers
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as e:
            raise BackendMissingError("transformers/torch not installed",
                                      hint="pip install 'infercourse[hf]'") from e
        kw = dict(gguf_file=src.name, dtype=torch.float32)
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), **kw)
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        if getattr(model, "hf_quantizer", None) is not None:
            # the GGUF loader marks the model "quantized"; the weights are plain fp32 now
            model.hf_quantizer.remove_quantization_config(model)
        model.save_pretrained(str(out))
        tok.save_pretrained(str(out))
        cfg_path = out / "config.json"
        cfg = json.loads(cfg_path.read_text())
        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
        if theta is None:
            theta = _gguf_rope_theta(src)
        cfg["rope_theta"] = float(theta)
        cfg_path.write_text(json.dumps(cfg, indent=2))
        return {"tool": "transformers", "version": transformers.__version__,
                "args": {"gguf_file": src.name, "dtype": "float32", "rope_theta": cfg["rope_theta"]}}

    return derive(derived_dir(src) / "hf", build, source=src)


def _gguf_rope_theta(src: Path) -> float:
    """The GGUF's RoPE base, from its header alone (`gguf_header`: no vocabulary decoded)."""
    from infercourse.models.gguf_header import read_header
    meta, _ = read_header(src)
    return float(meta[f"{meta['general.architecture']}.rope.freq_base"])


def llama_cpp_source() -> Path:
    """llama.cpp's Python tools (convert_hf_to_gguf.py, conversion/, gguf-py/), extracted
    from the llama-cpp-python sdist of the installed version: the wheel omits them, and
    the PyPI `gguf` package lags the converter it would have to match."""
    ver = version("llama-cpp-python")
    root = cache_dir() / "src" / f"llama.cpp-{ver}"

    def build(out: Path) -> dict:
        dl = cache_dir() / "src"
        sdist = dl / f"llama_cpp_python-{ver}.tar.gz"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
               "llama-cpp-python", f"llama-cpp-python=={ver}", "-d", str(dl)]
        if not sdist.is_file():
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0 or not sdist.is_file():
                raise RuntimeLayerError(f"could not fetch the llama-cpp-python {ver} sdist: "
                                        f"{r.stderr.strip()[-400:]}", hint=" ".join(cmd))
        prefix = f"llama_cpp_python-{ver}/vendor/llama.cpp/"
        wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
        with tarfile.open(sdist) as tf:
            for m in tf.getmembers():
                rel = m.name.removeprefix(prefix)
                if m.name.startswith(prefix) and rel.startswith(wanted) and m.isfile():
                    m.name = rel
                    tf.extract(m, out, filter="data")
        if not (out / "convert_hf_to_gguf.py").is_file():
            raise RuntimeLayerError(f"{sdist} has no vendor/llama.cpp/convert_hf_to_gguf.py")
        return {"tool": "pip download", "version": ver, "args": cmd}

    return derive(root, build)


def f16_gguf(source: str | Path | None = None) -> Path:
    """F16 GGUF made by llama.cpp's convert_hf_to_gguf.py from the HF folder.

    Args:
        source: a GGUF file; None for the embedded model.
    """
    src = source_gguf(source)
    hf = hf_folder(src)
    tools = llama_cpp_source()
    name = f"{_STEM}.F16.gguf"

    def build(out: Path) -> dict:
        cmd = [sys.executable, str(tools / "convert_hf_to_gguf.py"), str(hf),
               "--outtype", "f16", "--outfile", str(out / name)]
        env = {**os.environ, "PYTHONPATH": str(tools / "gguf-py")}
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise RuntimeLayerError(f"convert_hf_to_gguf.py failed: {r.stderr.strip()[-800:]}",
                                    hint=" ".join(cmd))
        return {"tool": "convert_hf_to_gguf.py", "version": version("llama-cpp-python"),
                "args": [str(hf), "--outtype", "f16", "--outfile", name]}

    return derive(derived_dir(src) / "gguf-F16", build, source=hf / "model.safetensors") / name


def quantized_gguf(qtype: str, source: str | Path | None = None, *, n_threads: int = 2) -> Path:
    """GGUF re-quantized to `qtype` (e.g. "Q4_K_M") by llama.cpp, from the F16 GGUF.

    We quantize from F16, not from the Q4_1 source, so errors do not compound (and
    llama.cpp refuses to requantize without `allow_requantize`). The name is llama.cpp's
    *request*: rows whose length is not a multiple of 256 cannot use K-quants and fall
    back to bigger types, so read the real bits per weight with `quant_ladder`.

    Args:
        qtype: a llama.cpp file type, as in `LLAMA_FTYPE_MOSTLY_<qtype>`.
        source: a GGUF file; None for the embedded model.
        n_threads: quantizer threads.
    """
    import llama_cpp
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype.upper()}", None)
    if ftype is None:
        raise ModelLayerError(f"unknown quantization type {qtype!r}",
                              hint=f"use one of {', '.join(LADDER)}")
    src = source_gguf(source)
    f16 = f16_gguf(src)
    name = f"{_STEM}.{qtype.upper()}.gguf"

    def build(out: Path) -> dict:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = ftype, n_threads
        rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(out / name).encode(),
                                            llama_cpp.byref(params))
        if rc != 0:
            raise RuntimeLayerError(f"llama_model_quantize({qtype}) returned {rc}")
        return {"tool": "llama_model_quantize", "version": version("llama-cpp-python"),
                "args": {"ftype": qtype.upper(), "input": f16.name, "nthread": n_threads}}

    return derive(derived_dir(src) / f"gguf-{qtype.upper()}", build, source=f16) / name


def quant_ladder(qtypes=LADDER, source: str | Path | None = None, *, with_nll: bool = False):
    """Derive each quantization and tabulate what the files really hold.

    Returns a DataFrame: name, path, bytes, bits_per_weight (8 x tensor bytes / params, read
    from the GGUF itself), file type as the file names it, and with `with_nll` the mean
    NLL of `quality.PARAGRAPH` (nats/token; ~10 s per row on 2 cores).
    """
    import pandas as pd
    from infercourse.models.modelcard import model_card
    rows = []
    for q in ("F16", *qtypes):
        path = f16_gguf(source) if q == "F16" else quantized_gguf(q, source)
        card = model_card(path)
        rows.append({"name": q, "path": str(path), "bytes": path.stat().st_size,
                     "bits_per_weight": card.bits_per_weight, "file_type": card.quantization})
        if with_nll:
            from infercourse.models.quality import mean_nll
            rows[-1]["mean_nll"] = mean_nll(path)
    return pd.DataFrame(rows)


def mlx_folder(quantize_bits: int | None = None, source: str | Path | None = None,
               *, group_size: int = 64) -> Path:
    """MLX folder converted by `mlx_lm.convert` from the HF folder; float or quantized.

    Args:
        quantize_bits: None for float (float32, as hf/), or 2/3/4/6/8 for MLX affine
            quantization with `group_size` weights per scale and bias.
        source: a GGUF file; None for the embedded model.
    """
    src = source_gguf(source)
    hf = hf_folder(src)

    def build(out: Path) -> dict:
        try:
            import mlx_lm
        except ImportError as e:
            raise BackendMissingError("mlx-lm is not installed",
                                      hint="pip install 'infercourse[mlx]'") from e
        out.rmdir()  # mlx_lm.convert refuses an existing folder
        args = dict(quantize=quantize_bits is not None, q_bits=quantize_bits,
                    q_group_size=group_size,
                    # float keeps fp32 (exact, as hf/); quantized uses bf16 scales as
                    # mlx-community models do
                    dtype="bfloat16" if quantize_bits else "float32")
        mlx_lm.convert(str(hf), mlx_path=str(out), **args)
        (out / ".mlx").write_text("converted by mlx_lm.convert\n")
        return {"tool": "mlx_lm.convert", "version": version("mlx-lm"), "args": args}

    sub = "mlx" if quantize_bits is None else f"mlx-q{quantize_bits}"
    return derive(derived_dir(src) / sub, build, source=hf / "model.safetensors")


def ensure_all(source: str | Path | None = None, qtypes=("Q8_0", "Q4_K_M", "Q2_K"),
               mlx: bool = True) -> list[dict]:
    """Derive the course's standard set once (HF, F16, a small ladder, MLX float and
    4-bit) and print what exists, with sizes and the seconds each derivation took."""
    steps = [("hf", lambda: hf_folder(source)), ("gguf-F16", lambda: f16_gguf(source))]
    steps += [(f"gguf-{q}", lambda q=q: quantized_gguf(q, source)) for q in qtypes]
    if mlx:
        steps += [("mlx", lambda: mlx_folder(None, source)), ("mlx-q4", lambda: mlx_folder(4, source))]
    if source is None:      # the mixture of experts upcycled from it, and the second family's file
        from infercourse.models import gemma3, moe
        steps += [("gguf-moe", lambda: moe.moe_gguf()), ("gguf-ffnx8", lambda: moe.wide_gguf()),
                  ("gemma3", gemma3.gemma3_gguf)]
    made = []
    for label, fn in steps:
        try:
            path = fn()
        except (BackendMissingError, ModelLayerError) as e:
            print(f"{label:10s} skipped: {e}")
            continue
        m = manifest(path)
        made.append({"name": label, "path": str(path), "bytes": m["output_bytes"],
                     "derive_s": m["seconds"], "tool": m["tool"]})
        print(f"{label:10s} {m['output_bytes'] / 1e6:8.1f} MB  derived in {m['seconds']:6.1f} s"
              f"  by {m['tool']}  ->  {path}")
    return made


def main(argv: list[str] | None = None) -> int:
    """`python -m infercourse formats [--no-mlx] [--ladder Q8_0,Q4_K_M,...]`."""
    import argparse
    ap = argparse.ArgumentParser(prog="infercourse formats", description=ensure_all.__doc__)
    ap.add_argument("--ladder", default="Q8_0,Q4_K_M,Q2_K", help="comma-separated GGUF types")
    ap.add_argument("--no-mlx", action="store_true", help="skip the MLX folders")
    ap.add_argument("--source", default=None, help="source GGUF (default: the embedded model)")
    a = ap.parse_args(argv)
    ensure_all(a.source, tuple(q for q in a.ladder.split(",") if q), mlx=not a.no_mlx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
