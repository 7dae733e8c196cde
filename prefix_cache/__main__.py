"""`python -m prefix_cache demo` (the main job), `python -m prefix_cache bench`,
`python -m prefix_cache soak` and `python -m prefix_cache channel gc`."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import NoReturn

from prefix_cache.tools.reporting.targets import METRICS


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr, exit code 2; `commands`: its subcommands."""

    commands: tuple[str, ...] = ()

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _bench_epilog() -> str:
    lines = ["metrics and their targets ((GPU): judged on an NVIDIA GPU only, shown elsewhere):"]
    lines += [f"  {name:<4} {spec.targets_text:<16} {spec.summary}"
              for name, spec in METRICS.items()]
    return "\n".join(lines)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def build_parser() -> _Parser:
    parser = _Parser(
        prog="python -m prefix_cache", formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="the engine benches run as modules of their own (each takes --help):\n"
               "  python -m prefix_cache.tools.pipeline_bench  M8 and the step time beside "
               "vLLM's plain worker\n"
               "  python -m prefix_cache.tools.stream_bench    M9: what streaming buys stage 2 "
               "and costs stage 1\n"
               "  python -m prefix_cache.tools.kill_test       stage 1 killed again and again: "
               "what stage 2 sees")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    demo = sub.add_parser(
        "demo", help="the two-stage pipeline (thinker -> channel -> talker) on vLLM's engine, "
                     "stage 1's prefix caching on vs off",
        description="Run the pipeline on vLLM's engine twice, stage 1's prefix caching on and "
                    "off, over requests that share prefixes; print a table per request (hits, "
                    "rows, the largest difference from the plain run) and the time of each run. "
                    "vLLM's logs go to a file the last line names. Exit status 1 when a row "
                    "differs beyond the device's tolerance.")
    demo.add_argument("--device", choices=("cpu", "cuda", "npu"),
                      help="the device the engines must run on (default: vLLM's platform here, "
                           "a GPU where vLLM's GPU build is installed); another is an error")
    demo.add_argument("--stream", action="store_true",
                      help="three stages (thinker -> talker -> codec), streaming on and off, "
                           "prefix caching on and off: time to the talker's first token and to "
                           "the first frame, and every output checked against the plain run")
    demo.add_argument("--stages", type=int, choices=(2, 3), default=None,
                      help="2: the two-stage demo (the default); 3: the three-stage one, as "
                           "--stream")
    bench = sub.add_parser(
        "bench", help="measure the cache's metrics (M1-M8) beside their references",
        description="Measure each metric beside its reference, in this process, and print one\n"
                    "table with a pass/MISS column against each target. Exit status: 0 once it\n"
                    "measured (a MISS included), 1 when a run failed, 2 on a usage error.",
        epilog=_bench_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("--device", metavar="NAME",
                       help="cpu, cuda, npu or a registered backend (default: the first present "
                            "of npu, cuda, cpu)")
    bench.add_argument("--quick", action="store_true",
                       help="fewer repetitions, smaller pools, no M8 and no scaling sweep; "
                            "under a minute on CPU")
    bench.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    bench.add_argument("--plot", metavar="PATH",
                       help="also draw the scaling sweep as a PNG at PATH (needs matplotlib, "
                            "the plot extra; not with --quick)")
    bench.add_argument("--runs", type=_positive_int, default=1, metavar="N",
                       help="run everything N times back to back; report each metric's median "
                            "and spread (default: 1)")
    soak = sub.add_parser(
        "soak", help="a stage under random faults, every entry checked against a run without "
                     "prefix caching: nothing wrong or lost",
        description="Run stage 1 (vLLM's engine with the cache, prefix caching and streaming "
                    "on) and a consumer process under a seeded schedule of faults (consumer "
                    "stalls and kills, producer kills with retries, aborts, expiries, duplicate "
                    "ids, preemption); check every delivered row; print a table. Exit status 1 "
                    "on any wrong or lost entry or engine death.")
    soak.add_argument("--minutes", type=_positive_float, default=2.0, metavar="N",
                      help="minutes of traffic, after the reference run and the first engine "
                           "start (default: 2)")
    soak.add_argument("--channel", default="shm", metavar="shm|mooncake|SPEC",
                      help="shm, mooncake (a loopback Mooncake Store started from this "
                           "checkout's tests/mooncake_store.py) or the mooncake://HOST:PORT"
                           "?metadata=URL of a running store (default: shm)")
    soak.add_argument("--seed", type=int, default=0,
                      help="seeds the prompts, the requests and the fault schedule (default: 0)")
    soak.add_argument("--faults", default=None, metavar="KINDS",
                      help="only these faults, separated by commas (consumer stall, consumer "
                           "kill, producer kill, abort, expiry, duplicate id), or none "
                           "(default: all)")
    channel = sub.add_parser("channel", help="manage stage channels on this machine",
                             description="Manage the stage channels on this machine: gc "
                                         "removes the shared-memory namespaces whose owner died.")
    channel_sub = channel.add_subparsers(dest="channel_command", required=True,
                                         parser_class=_Parser, metavar="COMMAND")
    gc = channel_sub.add_parser(
        "gc", help="remove the shared-memory namespaces whose owner died",
        description="List this user's shared-memory channel namespaces whose owning process "
                    "died, and remove them.")
    gc.add_argument("--dir", type=Path, metavar="ROOT",
                    help="where the namespaces lie (default: /dev/shm, else the temp dir)")
    gc.add_argument("--dry-run", action="store_true", help="list them, remove nothing")
    parser.commands = tuple(sub.choices)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # what there is to run, then the usage error
        parser.print_help(sys.stderr)
        parser.error(f"name a command: {', '.join(parser.commands)}")
    if args.command == "demo":
        if args.stream and args.stages == 2:
            parser.exit(2, f"{parser.prog} demo: error: --stream runs three stages; it does not "
                           f"go with --stages 2\n")
        from prefix_cache.tools import demo
        if args.stream or args.stages == 3:
            from prefix_cache.tools.stream_demo import run_stream_demo
            return demo.main(device=args.device, run=run_stream_demo, name="stream-demo")
        return demo.main(device=args.device)
    if args.command == "soak":
        from prefix_cache.tools import soak
        from prefix_cache.tools.demo import missing_packages
        try:
            faults = soak.FAULTS if args.faults is None else soak.fault_kinds(args.faults)
        except ValueError as exc:
            parser.exit(2, f"{parser.prog} soak: error: --faults: {exc}\n")
        if missing_packages():
            parser.exit(2, f"{parser.prog} soak: error: needs {' and '.join(missing_packages())}"
                           f" (bash ci/setup-cpu.sh installs them)\n")
        return soak.main(args.minutes, args.channel, args.seed, faults)
    if args.command == "channel":
        if args.dir is not None and not args.dir.is_dir():
            parser.exit(2, f"{parser.prog} channel gc: error: --dir {args.dir} is not a "
                           f"directory\n")
        from prefix_cache.tools import channel_gc
        return channel_gc.main(args.dir, dry_run=args.dry_run)
    from prefix_cache.tools import bench
    problem = (bench.unusable_device(args.device) or (args.json and bench.unwritable(args.json))
               or (args.plot and bench.unplottable(args.plot, args.quick)))
    if problem:
        parser.exit(2, f"{parser.prog} bench: error: {problem}\n")
    return bench.main(device=args.device, quick=args.quick, json_path=args.json, runs=args.runs,
                      plot_path=args.plot)


if __name__ == "__main__":
    sys.exit(main())
