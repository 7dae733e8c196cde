"""What the benches report with: timing and a run's spread (`harness`), the metrics' targets
(`targets`), results judged and printed (`bench_report`), and the scaling plot (`plot`)."""
