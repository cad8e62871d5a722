"""Resident memory of one GGUF load in a fresh process: the file's mapped pages and the rest."""
import pytest

from infercourse.measure.load_memory import gguf_load_memory, mapped_bytes

SMAPS = """\
55d0c000-55d0d000 r--p 00000000 08:01 123   /usr/bin/python3.11
Rss:                   4 kB
7f00000000-7f00100000 r--p 00000000 08:01 456   /models/a.gguf
Size:               1024 kB
Rss:                 512 kB
7f00100000-7f00200000 r--p 00100000 08:01 456   /models/a.gguf
Rss:                 256 kB
7f00200000-7f00300000 rw-p 00000000 00:00 0 
Rss:                1024 kB
7f00300000-7f00400000 r--p 00000000 08:01 789   /models/b.gguf
Rss:                  64 kB
"""


def test_mapped_bytes_sums_the_files_own_mappings_only():
    assert mapped_bytes(SMAPS, "/models/a.gguf") == (512 + 256) * 1024
    assert mapped_bytes(SMAPS, "/models/b.gguf") == 64 * 1024
    assert mapped_bytes(SMAPS, "/models/c.gguf") is None           # never mapped: unknown, not 0


@pytest.mark.slow
def test_a_fresh_load_maps_the_weights_and_adds_the_rest():
    import os
    from infercourse.models.embedded import embedded_gguf
    from infercourse.models.modelcard import model_card
    m = gguf_load_memory(embedded_gguf(), n_ctx=256)
    assert m["rss_delta_bytes"] == m["mapped_bytes"] + m["other_bytes"]
    # every weight page is touched by a request; the header is read, not mapped in
    assert m["mapped_bytes"] == pytest.approx(model_card(embedded_gguf()).tensor_bytes, rel=0.03)
    assert m["mapped_bytes"] < os.path.getsize(embedded_gguf()) and m["other_bytes"] > 0
