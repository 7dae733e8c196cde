"""The bench's measurements, one module per metric (`targets.METRICS` names them), over
`workload`'s rows and `harness`'s timing."""
