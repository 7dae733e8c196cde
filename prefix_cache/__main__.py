"""`python -m prefix_cache demo` (the main job) and `python -m prefix_cache bench`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefix_cache")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="vLLM's CPU engine end to end, checked against a cache-off run")
    bench = sub.add_parser("bench", help="measure M1-M7 side by side with their references")
    bench.add_argument("--device", choices=["cpu", "cuda", "npu"], default=None)
    bench.add_argument("--quick", action="store_true", help="small sizes; under a minute on CPU")
    bench.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from prefix_cache import demo
        return demo.main()
    from prefix_cache import bench as bench_mod
    return bench_mod.main(device=args.device, quick=args.quick, json_path=args.json)


if __name__ == "__main__":
    sys.exit(main())
