"""The cache core: the pool, write tasks and their committer, reads, deferred writes,
step layout, staging, host copies, output memory and the C loops (`_core`). Device-agnostic:
it reaches devices only through `prefix_cache.devices`.
"""
