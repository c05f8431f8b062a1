"""A video's sampled frame rate reaches the model's processor (issue 11).

mlx-vlm's Qwen3-VL processor writes each temporal patch group's time into the prompt
(``<1.0 seconds>``), computed from the rate the frames were sampled at; without it
mlx-vlm assumes 2 fps, so a clip sampled at 0.5 fps (``--video-fps``, or a long clip
spread over ``--video-max-frames``) would be described four times too fast. The
processor here is that one, over the tokenizer of a tiny qwen2_5_vl (same special
tokens, same chat template)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlxd.generation.params import GenerationRequest
from mlxd.media.types import VideoInput

pytest.importorskip("mlx_vlm")


@pytest.fixture(scope="module")
def inputs(session_dir: Path) -> Any:
    """A ``VisionInputProcessor`` over mlx-vlm's Qwen3-VL processor."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from mlx_vlm.utils import load

    from mlxd.engines.text.input_processor import InputLimits
    from mlxd.engines.vision.input import VisionInputProcessor
    from tests.helpers.tiny_vlm import build_tiny_vlm

    root = session_dir / "tiny-vlm"  # shared with tests/test_vision_families.py
    _, qwen25 = load(str(build_tiny_vlm("qwen2_5_vl", root / "qwen2_5_vl",
                                        root / "tokenizers")))
    processor = Qwen3VLProcessor(image_processor=qwen25.image_processor,
                                 tokenizer=qwen25.tokenizer,
                                 video_processor=qwen25.video_processor,
                                 chat_template=qwen25.chat_template)
    return VisionInputProcessor("q", TokenizerWrapper(qwen25.tokenizer),
                                InputLimits(4096, len(qwen25.tokenizer)), reasoning=None,
                                tool_format=None, grammar_tokenizer=None,
                                processor=processor, prepare_kwargs={})


def clip(fps: float, frames: int = 4) -> VideoInput:
    pictures = tuple(np.full((56, 56, 3), 40 * i, np.uint8) for i in range(frames))
    return VideoInput(sha256=f"clip-{fps}", frames=pictures, fps=fps,
                      seconds=frames / fps, width=56, height=56)


@pytest.mark.parametrize("fps,times", [(0.5, ["1.0", "5.0"]), (2.0, ["0.2", "1.2"]),
                                       (8.0, ["0.1", "0.3"])])
def test_the_sampled_fps_places_the_frames_in_time(inputs: Any, fps: float,
                                                   times: list[str]) -> None:
    request = GenerationRequest(messages=[{"role": "user", "content": [
        {"type": "video", "video": clip(fps)}, {"type": "text", "text": "What happens?"}]}])
    prepared = inputs.prepare(request)
    text = inputs.tokenizer.decode(prepared.tokens)
    # two groups of two frames, each at the mean time of its frames
    assert [f"<{t} seconds>" in text for t in times] == [True, True], text[:300]
