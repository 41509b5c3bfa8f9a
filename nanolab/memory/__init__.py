"""KV memory: where every running request's keys and values live (Lab 3; the radix cache: Lab 6).

`paging` (the block arithmetic, written once), `block_allocator` (free list and reference counts; the
C++ class or its Python twin), `block_manager` (a block table per request on top of an allocator and a
prefix cache), `paged_kv_cache` (the pool of KV tensors the model attends through), `paged_attention`
and `attention_backends` (attention that reads keys and values through block tables: torch gather or
the C++ kernel), `prefix_cache` (the contract of a prefix cache) and `radix_cache` (the reference one).
`fragmentation` simulates a stream of requests in one pool, contiguous or paged: what paging buys.
"""
