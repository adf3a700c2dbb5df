"""`jaxtune run [CONFIG] [--set section.key=value]... [--refresh STAGE]... [--until STAGE]`."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jaxtune.tasks import STAGES


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxtune",
        description="Fine-tune Hugging Face causal LMs on JAX through torchax, as a cached Prefect pipeline.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the finetune flow; cached stages are skipped")
    run.add_argument("config", nargs="?", help="YAML config (default: the bundled offline demo)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override one config value, e.g. --set train.max_steps=50 (repeatable)")
    run.add_argument("--refresh", action="append", default=[], metavar="STAGE",
                     help=f"recompute this stage even if cached (repeatable): {', '.join(STAGES)}")
    run.add_argument("--until", default="report", choices=STAGES, help="last stage to run")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Before Prefect is imported: no telemetry leaves this machine.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from jaxtune.config import ConfigError, load_config

    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"jaxtune: {e}", file=sys.stderr)
        return 2
    from jaxtune.flows.finetune import finetune

    result = finetune(config=config, refresh=args.refresh, until=args.until)
    # The temporary Prefect server logs its shutdown at exit; keep the report path the last line.
    logging.getLogger("prefect").setLevel(logging.WARNING)
    width = max(len(stage) for stage in result["stages"])
    for stage, state in result["stages"].items():
        print(f"{stage:<{width}}  {state}")
    print(result["path"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
