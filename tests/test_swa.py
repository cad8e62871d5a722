"""A second model family (Gemma 3 270M, sliding-window attention) and the prefix cache.

The file and its checks on synthetic data run everywhere; the live experiment runs on the
course's llama-server at a small size and skips, with the reason, where the Gemma package
is absent."""
from __future__ import annotations

import re

import pandas as pd
import pytest

from infercourse.core.errors import ModelLayerError
from infercourse.lessons import swa
from infercourse.models import gemma3
from infercourse.servers.llama_log import kv_caches, log_buffers

GEMMA_OK, GEMMA_WHY = gemma3.available()
needs_gemma = pytest.mark.skipif(not GEMMA_OK, reason=f"Gemma 3 not here: {GEMMA_WHY}")

ISWA_LOG = """llama_model_loader: loaded meta data
I llama_kv_cache_iswa: creating non-SWA KV cache, size = 8192 cells
I llama_kv_cache:        CPU KV buffer size =    24.00 MiB
I llama_kv_cache: size =   24.00 MiB (  8192 cells,   3 layers,  1/1 seqs), K (f16):   12.00 MiB, V (f16):   12.00 MiB
I llama_kv_cache_iswa: creating     SWA KV cache, size = 1024 cells
I llama_kv_cache:        CPU KV buffer size =    15.00 MiB
I llama_kv_cache: size =   15.00 MiB (  1024 cells,  15 layers,  1/1 seqs), K (f16):    7.50 MiB, V (f16):    7.50 MiB
"""


def says(text: str, phrase: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(phrase)}(?![\w-])", text) is not None


def test_the_log_parser_reads_both_caches_of_a_sliding_window_model():
    assert kv_caches(ISWA_LOG) == [{"kind": "global", "cells": 8192, "layers": 3, "mib": 24.0},
                                   {"kind": "local (SWA)", "cells": 1024, "layers": 15, "mib": 15.0}]
    assert log_buffers(ISWA_LOG)["kv_mib"] == 39.0
    one = "llama_kv_cache: size =   90.00 MiB (  4096 cells,  30 layers,  1/1 seqs)"
    assert kv_caches(one) == [{"kind": "full", "cells": 4096, "layers": 30, "mib": 90.0}]


def test_a_wrong_header_is_refused(tmp_path):
    """The pinned file must say gemma3 with a 512-token window: the embedded Llama does not."""
    from infercourse.models.embedded import embedded_gguf
    with pytest.raises(ModelLayerError, match="not the Gemma 3"):
        gemma3.check_header(embedded_gguf())


def test_the_embedded_model_has_no_window():
    from infercourse.models.embedded import embedded_gguf
    assert swa.sliding_window(embedded_gguf()) is None


@needs_gemma
def test_gemma_is_assembled_checked_and_has_its_window():
    from infercourse.models.embedded import file_sha256
    p = gemma3.gemma3_gguf()
    assert file_sha256(p) == gemma3.SHA256 and swa.sliding_window(p) == 512
    assert gemma3.check_header(p)["gemma3.context_length"] == 32768


def _runs(fam, full, rows):
    cols = ["prev_tokens", "prompt_tokens", "shared_tokens", "diverged_before_end", "beyond_window", "evaluated"]
    df = pd.DataFrame([dict(zip(cols, r)) for r in rows]).assign(family=fam, swa_full=full, window=512)
    df["full_attention_needs"] = (df["prompt_tokens"] - df["shared_tokens"]).clip(lower=1).where(df["prev_tokens"] > 0,
                                                                                                  df["prompt_tokens"])
    df["extra_evaluated"] = df["evaluated"] - df["full_attention_needs"]
    return df


def test_divergence_sentence_flips_with_what_the_server_evaluated():
    cold = (0, 1500, 0, None, False, 1500)
    rewound = _runs("G", False, [cold, (1500, 389, 376, 1124, True, 13), (1500, 1139, 1126, 374, False, 13)])
    refilled = _runs("G", False, [cold, (1500, 389, 376, 1124, True, 389), (1500, 1139, 1126, 374, False, 13)])
    a, b = swa.divergence_sentence(rewound), swa.divergence_sentence(refilled)
    assert "every one of 2 requests evaluated only what followed" in a and "more than full attention" not in a
    assert "1 of 2 requests evaluated more than full attention needs (376 tokens more; 1 of them the whole prompt)" in b
    assert "1 of the 1 that diverged more than the window" in b and "every one" not in b
    within = _runs("G", False, [cold, (1500, 389, 376, 13, False, 389)])     # shared 376 < 512: no resume
    assert "shorter than the window itself" in swa.divergence_sentence(within)


def test_chat_and_memory_sentences_are_computed():
    chat = pd.DataFrame([{"case": "the answer's reasoning dropped", "family": "G", "swa_full": False, "checkpoints": c,
                          "evaluated": e, "prompt_tokens": 1900, "extra_evaluated": e - 60,
                          "diverged_before_end": 700} for c, e in ((True, 64), (False, 1900))])
    s = swa.chat_sentence(chat)
    assert "G: 64 of 1,900 (4 more than full attention needs)" in s
    assert "G and `--ctx-checkpoints 0`: 1,900 of 1,900 (1,840 more than full attention needs, the whole prompt)" in s
    runs = []
    for full, local_cells, local_mib in ((False, 1024, 15.0), (True, 8192, 120.0)):
        r = pd.DataFrame({"family": ["G"], "swa_full": [full]})
        r.attrs["kv"] = [{"kind": "global", "cells": 8192, "layers": 3, "mib": 24.0},
                         {"kind": "local (SWA)", "cells": local_cells, "layers": 15, "mib": local_mib}]
        runs.append(r)
    kv = swa.kv_table(runs)
    m = swa.memory_sentence(kv)
    assert "39 MiB as is" in m and "144 MiB with `--swa-full` (3.7×" in m
    # at 32,768 tokens: global 24 x 4 = 96 both ways; local 15 as is, 480 with --swa-full
    assert "at 32,768 tokens the same arithmetic gives 111 against 576 MiB (5.2×)" in m
    assert "not shown" in swa.memory_sentence(kv[~kv["swa_full"]])


@pytest.mark.slow
@needs_gemma
def test_a_prompt_that_diverges_beyond_the_window_is_prefilled_again_on_gemma_only():
    """The live experiment at a small size: 700 tokens, one cut beyond the 512-token window and
    one inside it. On this build (pinned), Gemma 3 re-evaluates the whole cut prompt beyond the
    window, only the new ending inside it, and with --swa-full only the new ending anywhere;
    SmolLM2 (full attention) only the new ending anywhere."""
    present, _ = swa.families()
    out = {}
    for fam, path in present.items():
        for full in ((False, True) if "Gemma" in fam else (False,)):
            out[(fam, full)] = swa.prefix_runs(path, family=fam, swa_full=full, prompt_tokens=700, cuts=(0.1, 0.9),
                                               threads=2, ctx_size=2048)
    smol = out[("SmolLM2-135M (full attention)", False)]
    gemma, full = out[("Gemma 3 270M (sliding window)", False)], out[("Gemma 3 270M (sliding window)", True)]
    cut = lambda df, c: df[df["case"] == f"cut at {c:.0%}, new ending"].iloc[0]   # noqa: E731
    assert cut(gemma, 0.1)["beyond_window"] and not cut(gemma, 0.9)["beyond_window"]
    assert cut(gemma, 0.1)["evaluated"] == cut(gemma, 0.1)["prompt_tokens"]          # all of it, again
    assert cut(gemma, 0.9)["extra_evaluated"] == 0 and cut(full, 0.1)["extra_evaluated"] == 0
    assert (smol.loc[smol["prev_tokens"] > 0, "extra_evaluated"] == 0).all()
    kinds = {c["kind"]: c["cells"] for c in gemma.attrs["kv"]}
    assert kinds["global"] == 2048 and kinds["local (SWA)"] < 2048
    assert {c["kind"]: c["cells"] for c in full.attrs["kv"]}["local (SWA)"] == 2048


@pytest.mark.slow
@needs_gemma
def test_a_checkpoint_near_the_end_of_the_turn_rescues_a_dropped_answer_and_nothing_in_the_middle():
    """An agent turn on Gemma 3: dropping the answer the model just wrote (600 tokens back,
    beyond the window) is served from the checkpoint llama-server made near the end of the
    turn's prompt; with --ctx-checkpoints 0 the whole prompt is evaluated again."""
    path = gemma3.gemma3_gguf()
    fam = "Gemma 3 270M (sliding window)"
    on = swa.chat_runs(path, family=fam, answer_tokens=560, n_turns=2, threads=2).set_index("case")
    off = swa.chat_runs(path, family=fam, checkpoints=False, answer_tokens=560, n_turns=2, threads=2).set_index("case")
    dropped = swa.CHAT_CASES[1]
    assert on.loc[dropped, "beyond_window"] and on.loc[dropped, "diverged_before_end"] == 560
    assert on.loc[dropped, "extra_evaluated"] < 20                          # back to the checkpoint, 4 tokens back
    assert off.loc[dropped, "evaluated"] == off.loc[dropped, "prompt_tokens"]  # no checkpoint: all of it
    assert (on.loc[swa.CHAT_CASES[0], "extra_evaluated"] <= 1) and (off.loc[swa.CHAT_CASES[0], "extra_evaluated"] <= 1)
