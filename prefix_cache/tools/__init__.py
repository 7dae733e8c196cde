"""What people run: one module per command (`python -m prefix_cache --help` lists them; the
benches also run as `python -m prefix_cache.tools.NAME`). What the commands share sits below,
one subpackage a concern: `pipelines` (the engines and stages they start), `reporting` (timing,
targets, tables, plots), `metrics` (the bench's measurements) and `profiling`.
"""
