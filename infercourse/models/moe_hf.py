"""The upcycled mixture of experts in the Hugging Face format: a Mixtral folder.

transformers' `MixtralForCausalLM` is the llama block with a mixture-of-experts FFN: the same
attention, RMSNorm and rotary embeddings, tied embeddings when asked (SmolLM2 ties them), and a
router (`MixtralTopKRouter`) that takes the softmax over all experts, keeps the top k and
divides them by their sum. So the upcycled model of `models.moe` (every expert a copy of the
dense MLP, the same seeded router matrices) is a Mixtral checkpoint whose output is the dense
model's, derived here from `formats.hf_folder` (float32, like it).

transformers 5 holds the experts fused (`experts.gate_up_proj`, E × 2·ff × hidden) and saves
them in the hub's per-expert layout (`block_sparse_moe.experts.<e>.w1/w2/w3`), the layout
Mixtral checkpoints have, which llama.cpp's convert_hf_to_gguf.py and vLLM read too. Float32 and
E full-size experts: 4 × (shared + E × FFN) bytes, 2.8 GB for E = 8.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from infercourse.core.errors import ModelLayerError
from infercourse.models.derive import derive, derived_dir, source_gguf
from infercourse.models.moe import router_weights

__all__ = ["moe_hf_folder"]


def moe_hf_folder(n_expert: int = 8, n_used: int = 2, *, seed: int = 0, source: str | Path | None = None) -> Path:
    """The MoE of `models.moe.moe_gguf` as a `MixtralForCausalLM` folder (module docstring):
    experts = copies of the dense MLP, routers = `models.moe.router_weights(seed)`.

    Args:
        n_expert, n_used, seed: as `moe_gguf`.
        source: a GGUF file; None for the embedded model.
    """
    from infercourse.models.formats import hf_folder
    src = source_gguf(source)
    hf = hf_folder(src)

    def build(out: Path) -> dict:
        import torch
        import transformers
        from safetensors.torch import load_file
        from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM
        cfg = json.loads((hf / "config.json").read_text())
        if cfg.get("model_type") != "llama":
            raise ModelLayerError(f"{hf} holds a {cfg.get('model_type')!r} model; upcycling here needs llama")
        keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
                "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings", "rope_parameters")
        config = MixtralConfig(**{k: cfg[k] for k in keep if k in cfg}, num_local_experts=n_expert,
                               num_experts_per_tok=n_used, sliding_window=None, dtype="float32")
        dense = load_file(str(hf / "model.safetensors"))
        routers = router_weights(config.num_hidden_layers, n_expert, config.hidden_size, seed)
        state = {}
        for k, v in dense.items():
            m = re.match(r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight$", k)
            if not m:
                state[k] = v
            elif m.group(2) == "down":
                i = m.group(1)
                gate_up = torch.cat([dense[f"model.layers.{i}.mlp.gate_proj.weight"],
                                     dense[f"model.layers.{i}.mlp.up_proj.weight"]])
                state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = gate_up.expand(n_expert, *gate_up.shape).clone()
                state[f"model.layers.{i}.mlp.experts.down_proj"] = v.expand(n_expert, *v.shape).clone()
                state[f"model.layers.{i}.mlp.gate.weight"] = torch.from_numpy(routers[int(i)].copy())
        with torch.device("meta"):
            model = MixtralForCausalLM(config)
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        missing = [k for k in missing if k != "lm_head.weight"]     # tied to the embedding
        if missing or unexpected:
            raise ModelLayerError(f"Mixtral state does not match: missing {missing[:4]}, unexpected {unexpected[:4]}")
        model.tie_weights()
        model.save_pretrained(str(out))
        AutoTokenizer.from_pretrained(str(hf)).save_pretrained(str(out))
        return {"tool": "infercourse.models.moe_hf.moe_hf_folder", "version": transformers.__version__,
                "args": {"n_expert": n_expert, "n_used": n_used, "seed": seed, "dtype": "float32",
                         "architecture": "MixtralForCausalLM", "experts": "copies of the dense MLP"}}

    return derive(derived_dir(src) / f"hf-moe{n_expert}x{n_used}-s{seed}", build, source=hf / "model.safetensors")
