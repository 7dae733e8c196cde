"""What people run and read: the demo, the pipeline and its bench, the benchmark harness,
the engines they start and the metric targets.
"""
