"""The paged KV cache: stored row formats, the block allocator, per-layer pools of sequences,
and the per-step plan that tells the layer where each token's rows live."""
