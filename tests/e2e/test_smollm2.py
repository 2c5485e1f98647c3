"""builtin:smollm2-135m through TransformersEngine answers a short chat in English.

Uses the real cache (``GPUPOOL_CACHE`` or ``~/.cache/gpupool``): the first run converts the bundled
GGUF there once (about 20 s on a small CPU), later runs reuse it, as ``gpupool up`` does.
"""

from __future__ import annotations

import os
import re

import pytest

from replica import models
from replica.engine import ChatMessage, Delta, Done, GenerationParams
from replica.transformers_engine import TransformersEngine


@pytest.mark.slow
async def test_smollm2_answers_a_short_chat_in_english() -> None:
    engine = TransformersEngine(
        models.SMOLLM2, device="cpu", cache_dir=models.default_cache_dir(os.environ)
    )
    await engine.load()
    try:
        assert engine.model_id == "smollm2-135m"
        # A request that sets no sampling gets the model card's (what `gpupool up` users see).
        assert engine.default_sampling == (0.2, 0.9)
        prompt = engine.render_chat([ChatMessage("user", "What is the capital of France?")])
        events = [
            event async for event in engine.stream(prompt, GenerationParams(max_tokens=24, seed=0))
        ]
    finally:
        await engine.close()
    text = "".join(e.text for e in events if isinstance(e, Delta))
    done = events[-1]
    assert isinstance(done, Done)
    assert done.prompt_tokens > 5 and 0 < done.completion_tokens <= 24
    assert sum(1 for e in events if isinstance(e, Delta) and e.text) >= 2  # streamed
    assert re.search(r"[A-Za-z]{3,}", text), text
    assert re.search(r"\b(Paris|France)\b", text), text  # a plausible answer, not a fixed one
    assert "<|im_end|>" not in text and "\ufffd" not in text
