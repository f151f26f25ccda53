"""dsi: Distributed Speculative Inference."""
