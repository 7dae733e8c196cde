"""The bench's measurements, one module per metric (`reporting.targets.METRICS` names them),
over `workload`'s rows and `reporting.harness`'s timing."""
