"""`python -m jaxtune.cli ...`: the `jaxtune` command, as the command re-executes itself and a
multi-process launch starts each process."""

from jaxtune.cli.main import entry

entry()
