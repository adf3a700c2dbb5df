"""`jaxtune run [CONFIG] [--set section.key=value]... [--refresh STAGE]... [--until STAGE]`
and `jaxtune doctor MODEL [--config CONFIG] [--set section.key=value]...`."""

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
    doctor = commands.add_parser(
        "doctor", help="check a model's JAX numerics against PyTorch and its training memory; exit 1 when parity fails"
    )
    doctor.add_argument("model", help="hub id (e.g. google/gemma-3-1b-it) or local model directory")
    doctor.add_argument("--config", help="YAML config whose lora, train and data.max_length are used (default: built-in defaults)")
    doctor.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value (repeatable)")
    doctor.add_argument("--revision", help="hub revision")
    doctor.add_argument("--tokens", type=int, default=48, help="sequence length of the parity batch")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Before Prefect is imported: no telemetry leaves this machine.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from jaxtune.config import ConfigError, config_from_dict, load_config

    try:
        if args.command == "doctor" and args.config is None:
            config = config_from_dict({}, args.overrides, where="--set")
        else:
            config = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"jaxtune: {e}", file=sys.stderr)
        return 2
    if args.command == "doctor":
        return _doctor(args, config)
    from jaxtune.flows.finetune import finetune

    result = finetune(config=config, refresh=args.refresh, until=args.until)
    # The temporary Prefect server logs its shutdown at exit; keep the report path the last line.
    logging.getLogger("prefect").setLevel(logging.WARNING)
    width = max(len(stage) for stage in result["stages"])
    for stage, state in result["stages"].items():
        print(f"{stage:<{width}}  {state}")
    print(result["path"])
    return 0


def _doctor(args, config) -> int:
    from jaxtune.doctor import DoctorError, diagnose, render

    try:
        diagnosis = diagnose(args.model, config, revision=args.revision, tokens=args.tokens)
    except (DoctorError, OSError) as e:
        print(f"jaxtune doctor: {e}", file=sys.stderr)
        return 2
    print(render(diagnosis))
    return 0 if diagnosis.ok else 1


if __name__ == "__main__":
    sys.exit(main())
