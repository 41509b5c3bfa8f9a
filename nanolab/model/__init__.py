"""The model: what one forward computes, and what it needs from whoever owns the batch (Lab 2 builds it).

`config` (`ModelConfig`), `transformer` (GPT-2 and Llama families; each layer hands its q, k, v to a KV
cache), `kv_cache` (the `KVCacheProtocol` seam, the contiguous single-sequence cache and the KV bytes
formula), `attention` (the dense causal reference and the one call into PyTorch's fused kernel),
`sampling` (`SamplingParams`, greedy / temperature / top-k / top-p / min-p), `generate` (the
one-request generation loop), `loading` and `hf` (checkpoints: nanolab's own and Hugging Face's).
Nothing here knows about blocks, requests or schedules.
"""
