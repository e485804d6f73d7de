"""Images in prompts: loading what clients send, the model's processor (placeholder tokens,
pixel tensors), the vision encoder, and what a sequence carries through the engine."""
