"""`jaxtune run [CONFIG] [--set section.key=value]... [--refresh STAGE]... [--until STAGE]`,
`jaxtune serve [--only DEPLOYMENT]...`,
`jaxtune doctor MODEL [--config CONFIG] [--set section.key=value]...`,
`jaxtune chat SOURCE [sampling flags]`, `jaxtune generate SOURCE PROMPT... [--prompts-file FILE]` and
`jaxtune launch --processes N [--ray ADDRESS [--tpu VERSION TOPOLOGY] [--restarts K]] [--cpu-devices K] -- CMD...`."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import signal
import sys
from pathlib import Path

from jaxtune.tasks import BUILD_STAGES, STAGES

REFRESHABLE = (*BUILD_STAGES, *STAGES)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxtune",
        description="Fine-tune Hugging Face causal LMs on JAX through torchax, as a cached Prefect pipeline.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the finetune flow; cached stages are skipped")
    run.add_argument("config", nargs="?", help="YAML config (default: the bundled offline demo)")
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value, e.g. --set train.max_steps=50 (repeatable)",
    )
    run.add_argument(
        "--refresh",
        action="append",
        default=[],
        metavar="STAGE",
        type=_stage_of(REFRESHABLE),
        help=f"recompute this stage even if cached (repeatable): {', '.join(REFRESHABLE)}",
    )
    run.add_argument(
        "--until",
        default="report",
        metavar="STAGE",
        type=_stage_of(STAGES),
        help=f"last stage to run: {', '.join(STAGES)} (default: %(default)s)",
    )
    run.add_argument(
        "--debug", action="store_true", help="print the Python tracebacks of a failure, not only its message"
    )
    serve = commands.add_parser(
        "serve", help="serve prefect.yaml's deployments with their schedules from this process (no work pool needed)"
    )
    serve.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="DEPLOYMENT",
        help="serve only this deployment (repeatable; default: all of them)",
    )
    serve.add_argument(
        "--prefect-yaml", default="prefect.yaml", help="file declaring the deployments (default: %(default)s)"
    )
    serve.add_argument("--limit", type=int, default=1, help="flow runs at once (default: %(default)s)")
    doctor = commands.add_parser(
        "doctor", help="check a model's JAX numerics against PyTorch and its training memory; exit 1 when parity fails"
    )
    doctor.add_argument("model", help="hub id (e.g. google/gemma-3-1b-it), local model directory, or .gguf file")
    doctor.add_argument(
        "--config", help="YAML config whose lora, train and data.max_length are used (default: built-in defaults)"
    )
    doctor.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable)",
    )
    doctor.add_argument("--revision", help="hub revision")
    doctor.add_argument("--tokens", type=int, default=48, help="sequence length of the parity batch")
    doctor.add_argument(
        "--target",
        metavar="ACCELERATOR",
        nargs="?",
        const="",
        help="plan the train step for an accelerator instead, compiled here without it, from the model's "
        "config alone (no weights read, no parity): v5e-1, v5e-8, v6e-1, v5p-8, v4-8, a TPU "
        "topology such as v5e:2x4, or h100, h200, a100 (-8 for eight); exit "
        "1 when it does not fit (--target alone: the config's plan.target)",
    )
    chat = commands.add_parser("chat", help="talk with a trained or base model; answers stream as they are decoded")
    _decoding_arguments(chat)
    chat.add_argument("--show-prompt", action="store_true", help="write each turn's rendered prompt to stderr")
    generate = commands.add_parser("generate", help="answer prompts, one answer a line on stdout; tokens/s on stderr")
    _decoding_arguments(generate)
    generate.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts, each answered alone")
    generate.add_argument("--prompts-file", help='more prompts: one a line, or a .jsonl file with a "prompt" field')
    generate.add_argument(
        "--jsonl", action="store_true", help='write {"prompt", "answer"} lines instead of plain answers'
    )
    launch = commands.add_parser(
        "launch",
        help="run a jaxtune command as a job of several JAX processes (multi-host), e.g. "
        "jaxtune launch --processes 2 --cpu-devices 4 -- run",
        description="Start the jaxtune command after -- once per process, with JAX_COORDINATOR_ADDRESS, "
        "JAX_NUM_PROCESSES and JAX_PROCESS_ID set: on this host, or with --ray one per node of a Ray cluster "
        "(one per host of a TPU slice with --tpu). Each output line is prefixed [i]; when a process fails the "
        "others are stopped and its exit status is launch's. The artifact store must be a folder every host sees.",
    )
    launch.add_argument("--processes", type=int, metavar="N", help="processes in the job (with --tpu: its hosts')")
    launch.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run the job on this Ray cluster ('auto': the one this host belongs to), its processes reserved as "
        "one gang on distinct nodes and restarted together after a failure (the ray extra)",
    )
    launch.add_argument(
        "--tpu",
        nargs=2,
        metavar=("VERSION", "TOPOLOGY"),
        help="with --ray: one process on each host of a TPU slice, e.g. --tpu v5e 4x4 (a v5e-16: 4 hosts)",
    )
    launch.add_argument(
        "--restarts",
        type=int,
        default=0,
        metavar="K",
        help="with --ray: start the whole job again up to K times after a failure that may not repeat "
        "(a process killed, a node lost); the train stage resumes from its last checkpoint",
    )
    launch.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="address of process 0's coordinator, without --ray (default: 127.0.0.1 on a free port)",
    )
    launch.add_argument(
        "--cpu-devices",
        type=int,
        metavar="K",
        help="for testing on one machine: each process runs on K fake CPU devices "
        "(XLA_FLAGS=--xla_force_host_platform_device_count=K, JAX_PLATFORMS=cpu)",
    )
    launch.add_argument(
        "arguments",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND",
        help="the jaxtune command each process runs, e.g. -- run RECIPE --set mesh.fsdp=4",
    )
    return parser


def _stage_of(stages: tuple[str, ...]):
    """An argparse type accepting one of `stages`, or naming them with a did-you-mean."""

    def stage(value: str) -> str:
        if value in stages:
            return value
        close = difflib.get_close_matches(value, stages, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise argparse.ArgumentTypeError(f"unknown stage {value!r}; {hint}stages: {', '.join(stages)}")

    return stage


def _decoding_arguments(parser: argparse.ArgumentParser) -> None:
    from jaxtune.config import StoreConfig

    parser.add_argument(
        "source",
        help="a report, export or train artifact folder of the store, a hub id, "
        "a local HF model folder, or a .gguf file",
    )
    parser.add_argument("--max-new-tokens", type=int, default=256, help="longest answer, in tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (the default) decodes greedily")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="sample from the most likely tokens holding this much probability"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (each answer starts from it)")
    parser.add_argument("--system", help="a system message before the conversation")
    parser.add_argument(
        "--store", default=StoreConfig().root, help="store a .gguf file is imported into (default: %(default)s)"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "launch":
        return _launch(args)
    # Before Prefect is imported: no telemetry leaves this machine.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    _local_servers()
    if args.command in ("chat", "generate"):
        return _decode(args)
    if args.command == "serve":
        return _serve(args)
    from jaxtune.config import config_from_dict, load_config
    from jaxtune.errors import ConfigError

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
    try:
        _join_job(config)
    except (RuntimeError, ValueError) as e:  # JAX's: no coordinator, a timeout, settings that do not fit
        if args.debug:
            raise
        print(f"jaxtune: cannot join the multi-process job: {_one_line(e)}", file=sys.stderr)
        return 1
    status = _run(args, config)
    _leaving.status = status
    return status


def _run(args, config) -> int:
    """`jaxtune run` once its config is loaded (and its job joined)."""
    from jaxtune.checks import preflight
    from jaxtune.config import OFFLINE
    from jaxtune.errors import REPEATS, ConfigError, TrainingStopped, chain

    try:
        preflight.check(config)
    except ConfigError as e:
        print(f"jaxtune: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:  # DataError, ModelError: the data or model named is not there or unusable
        if args.debug:
            raise
        print(f"jaxtune: {_one_line(e)}", file=sys.stderr)
        return 1
    from jaxtune.flows.finetune import STAGE_NOTE, finetune
    from jaxtune.host.temporary_server import start_guarded

    if not args.debug:
        _console_without_tracebacks()
    try:
        start_guarded()
        result = finetune(
            recipe=args.config or OFFLINE, overrides=args.overrides, refresh=args.refresh, until=args.until
        )
    except Exception as error:
        # A stop is no failure: the run saved its place and goes on when started again. Prefect
        # may have raised another error while recording it, its server stopped by the same signal.
        stopped = next((e for e in chain(error) if isinstance(e, TrainingStopped)), None)
        if stopped is not None:
            logging.getLogger("prefect").setLevel(logging.WARNING)
            print(f"jaxtune: train: {stopped}", file=sys.stderr)
            return 128 + (signal.SIGINT if stopped.signal == "SIGINT" else signal.SIGTERM)  # as the signal's own exit
        if args.debug:
            raise
        # The temporary Prefect server logs its shutdown at exit; keep the error the last line.
        logging.getLogger("prefect").setLevel(logging.WARNING)
        stage = next(
            (note[len(STAGE_NOTE) :] for note in getattr(error, "__notes__", []) if note.startswith(STAGE_NOTE)), None
        )
        print(
            f"jaxtune: {f'{stage}: ' if stage else ''}{_one_line(error)} (--debug shows the traceback)", file=sys.stderr
        )
        return 2 if any(isinstance(e, REPEATS) for e in chain(error)) else 1
    # The temporary Prefect server logs its shutdown at exit; keep the report path the last line.
    logging.getLogger("prefect").setLevel(logging.WARNING)
    width = max(len(stage) for stage in result["stages"])
    for stage, state in result["stages"].items():
        print(f"{stage:<{width}}  {state}")
    print(result["path"])
    return 0


def _join_job(config) -> None:
    """In a multi-process job (`jaxtune launch`, or the mesh.* / JAX_* settings): join it now, so
    the preflight counts every process's devices (JAX fixes its device list on first use). A
    process other than 0 whose Prefect runs a temporary server (no PREFECT_API_URL) keeps its
    records in a database of its own, deleted at exit: processes on one machine would otherwise
    share, and race to migrate, the one in PREFECT_HOME; process 0's run is the job's record."""
    from jaxtune.host import processes

    if not processes.join(config.mesh):
        return
    import atexit

    # Registered after JAX's exit handler (it shuts the job's client down), so run before it, and after Prefect's.
    atexit.register(_leaving)
    if processes.writes() or any(
        os.environ.get(f"PREFECT_{kind}_DATABASE_CONNECTION_URL") for kind in ("SERVER", "API")
    ):
        return
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix=f"jaxtune-prefect-{processes.index}-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # registered first, so run after Prefect's server stops
    os.environ["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = f"sqlite+aiosqlite:///{folder}/prefect.db"


def _leaving() -> None:
    """At the exit of a process of a multi-process job: when its run failed, exit at once. JAX's
    client would otherwise wait, up to its shutdown timeout (5 minutes), for the other processes
    to reach its shutdown barrier, which they do not while they wait in a collective for this one."""
    if _leaving.status != 0:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_leaving.status)


_leaving.status = 1  # until `main` returns another: an error it raised (--debug) is a failure too


def _local_servers() -> None:
    """Servers jaxtune starts listen on this machine only: Prefect's temporary API server (its
    default already) and the webserver of a served deployment (Prefect's default is 'localhost',
    which some resolvers map to every interface's name).

    The temporary server is given two minutes to answer rather than Prefect's 20 s: its first start
    in a new Prefect home creates and migrates the database, which on a busy 2-core machine took
    longer than 20 s, and `jaxtune run` then failed before its first stage."""
    os.environ.setdefault("PREFECT_SERVER_API_HOST", "127.0.0.1")
    os.environ.setdefault("PREFECT_RUNNER_SERVER_HOST", "127.0.0.1")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


def _one_line(error: BaseException) -> str:
    from jaxtune.errors import first_line

    return first_line(error)


class _WithoutTraceback(logging.Formatter):
    """Formats a record as `inner` does, leaving out its traceback (the record keeps it for Prefect's API handler)."""

    def __init__(self, inner: logging.Formatter | None):
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


def _console_without_tracebacks() -> None:
    """A failed stage logs its traceback through Prefect's console handlers; on the console the
    error's one line is enough, while the run recorded by Prefect keeps the whole traceback."""
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler, PrefectConsoleHandler) and not isinstance(handler.formatter, _WithoutTraceback):
                handler.setFormatter(_WithoutTraceback(handler.formatter))


def _launch(args) -> int:
    from jaxtune.host import launch

    arguments = args.arguments[1:] if args.arguments[:1] == ["--"] else args.arguments
    if arguments and arguments[0] != "launch":
        _parser().parse_args(arguments)  # a mistake in the command exits 2 here, not once in every process
    if args.ray is None:
        for flag, given in (("--tpu", args.tpu), ("--restarts", args.restarts)):
            if given:
                print(f"jaxtune launch: {flag} needs --ray", file=sys.stderr)
                return 2
        if args.processes is None:
            print("jaxtune launch: --processes is needed (or --ray with --tpu)", file=sys.stderr)
            return 2
        return launch.main(args.processes, arguments, args.coordinator, args.cpu_devices)
    from jaxtune.errors import LaunchError
    from jaxtune.host import ray_job

    try:
        gang = ray_job.gang(args.processes, tuple(args.tpu) if args.tpu else None)
        return ray_job.run(arguments, gang, args.ray, args.cpu_devices, args.restarts)
    except LaunchError as error:
        print(f"jaxtune launch: {error}", file=sys.stderr)
        return 2


def _serve(args) -> int:
    from jaxtune.errors import ServeError
    from jaxtune.flows.serve import serve

    try:
        serve(args.prefect_yaml, args.only, args.limit)
    except ServeError as e:
        print(f"jaxtune serve: {e}", file=sys.stderr)
        return 2
    return 0


def _doctor(args, config) -> int:
    from jaxtune.checks.doctor import diagnose, render
    from jaxtune.errors import DoctorError, ModelError, TargetError

    if args.target == "":  # --target with no name: the one the config is written for
        if not config.plan.target:
            print(
                "jaxtune doctor: --target names no accelerator and the config sets no plan.target: "
                "give one, e.g. --target v5e-1",
                file=sys.stderr,
            )
            return 2
        args.target = config.plan.target
    if args.target:
        # Planning compiles for the target's devices alone: no local accelerator is looked for.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if config.store.compile_cache:
        _compile_cache(config.store.root)
    try:
        if args.target:
            from jaxtune.checks.target_plan import plan_for_target

            name, base_revision = _planned_model(args.model)
            diagnosis = plan_for_target(name, config, args.target, revision=args.revision or base_revision)
        else:
            diagnosis = diagnose(_model_folder(args.model, config), config, revision=args.revision, tokens=args.tokens)
    except (DoctorError, TargetError, ModelError, OSError) as e:
        print(f"jaxtune doctor: {e}", file=sys.stderr)
        return 2
    print(render(diagnosis))
    return 0 if diagnosis.ok else 1


def _decode(args) -> int:
    from jaxtune.cli import chat

    chat.quiet_loading()
    _compile_cache(args.store)
    try:
        prompts = chat.read_prompts(args.prompts, args.prompts_file) if args.command == "generate" else []
        session = chat.open_session(
            args.source, args.store, args.max_new_tokens, args.seed, args.temperature, args.top_k, args.top_p
        )
        if args.command == "chat":
            chat.require_chat_template(session)
    except (ValueError, OSError) as e:  # SourceError, bad flags, files the model needs
        print(f"jaxtune {args.command}: {_one_line(e)}", file=sys.stderr)
        return 2
    if args.command == "chat":
        chat.chat(session, sys.stdin, sys.stdout, sys.stderr, system=args.system, show_prompt=args.show_prompt)
    else:
        chat.generate(session, prompts, sys.stdout, sys.stderr, system=args.system, jsonl=args.jsonl)
    return 0


def _compile_cache(store_root: str) -> None:
    from jaxtune.runtime.devices import compile_cache

    compile_cache.enable(compile_cache.folder_of(store_root))


def _model_folder(name: str, config) -> str:
    """`name` itself; for a .gguf file the HF folder it is imported to in the store, and for a
    LoRA adapter folder the model merged from it and its base, as a run from it starts (each once)."""
    from jaxtune.tasks.sources import adapter_folder, model_ref

    path = Path(name).expanduser()
    if name.lower().endswith(".gguf"):
        from jaxtune.tasks.import_gguf import imported

        ref = imported(config.store.root, model_ref(config.model.model_copy(update={"name": name})))
        print(f"jaxtune: {name} imported as {ref.path}", file=sys.stderr)
        return ref.path
    if path.is_dir() and adapter_folder(path) is not None:
        from jaxtune.tasks.merge_adapter import merged

        ref = merged(
            config.store.root, model_ref(config.model.model_copy(update={"name": name})), config.model.trust_remote_code
        )
        print(f"jaxtune: the LoRA adapter {name} merged into its base as {ref.path}", file=sys.stderr)
        return ref.path
    return name


def _planned_model(name: str) -> tuple[str, str | None]:
    """What a target's plan reads the architecture of: `name`, or a LoRA adapter folder's base
    (merging changes no shape), with the base's revision."""
    from jaxtune.tasks.sources import adapter_base, adapter_folder

    path = Path(name).expanduser()
    if path.is_dir() and (adapter := adapter_folder(path)) is not None:
        base = adapter_base(adapter)
        return base.name, base.revision
    return name, None


def entry() -> None:
    """The `jaxtune` command: `main` under a fixed string-hash seed.

    Model code iterates over sets of strings while it is traced (Gemma 3 builds its rotary
    embeddings in `set(layer_types)` order), so under Python's random hash seed the same step
    traces to differently ordered programs in different processes, and the persistent
    compilation cache misses about half the time. A fixed seed makes every process trace the
    same program.
    """
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "jaxtune.cli", *sys.argv[1:]])
    sys.exit(main())


if __name__ == "__main__":
    entry()
