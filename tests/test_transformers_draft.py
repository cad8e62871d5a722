"""TransformersEngine with a draft model: k is pinned where transformers 5 reads it (the
assistant's generation config), so every step proposes exactly `assistant_tokens`."""
import pytest


@pytest.mark.slow
def test_assistant_tokens_pin_the_drafting_schedule():
    from infercourse.core.trace import record
    from infercourse.core.types import Request
    from infercourse.engines.transformers_engine import TransformersEngine
    from infercourse.models.formats import hf_folder
    eng = TransformersEngine(n_threads=1, assistant=hf_folder(), assistant_tokens=2)
    cfg = eng.assistant_model.generation_config
    assert (cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule, eng.draft_k) == (2, "constant", 2)
    assert cfg.assistant_confidence_threshold == 0.0
    tr = record(eng, Request(messages=[{"role": "user", "content": "Name three colours."}], max_tokens=9,
                             ignore_eos=True), raise_errors=True)
    # the target itself as draft: all k accepted, so every chunk is k + 1 = 3 tokens
    assert tr.chunk_tokens == [3, 3, 3]
    assert TransformersEngine(n_threads=1).draft_k is None
