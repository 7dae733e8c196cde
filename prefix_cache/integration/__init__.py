"""vLLM integration: the gate, group views, the runner mixins (V1, V2) and workers,
forward-output reading, the stage-output driver, delivery and the output thread.
"""
