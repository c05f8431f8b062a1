"""Vision-language models (mlx-vlm): the engine, its prompts, image features, decoding and the
reversible patches of mlx-vlm."""
