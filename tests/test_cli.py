"""The `pdserve` command line: every subcommand's help, and which processes import torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.cli import BENCHMARKS, SERVICES

COMMANDS = ["demo", "generate", "up", "status", "serve", *(name for name, _, _ in SERVICES),
            *(f"bench {name}" for name, _, _ in BENCHMARKS)]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_every_subcommand_prints_its_help():
    # one process: argparse's help formatting is what fails (a bare % in a help text)
    code = ("import contextlib, io, sys\n"
            "from pdserve.cli import build_parser\n"
            f"for command in {COMMANDS!r}:\n"
            "    out = io.StringIO()\n"
            "    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
            "        build_parser().parse_args([*command.split(), '--help'])\n"
            "    assert 'usage: pdserve ' + command in out.getvalue(), command\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_top_level_help_names_every_subcommand():
    done = _cli("--help")
    assert done.returncode == 0, done.stderr
    for name in ("demo", "generate", "up", "status", "serve", "bench",
                 *(name for name, _, _ in SERVICES)):
        assert name in done.stdout


@pytest.mark.parametrize("command", ["up", "status", "gateway", "tokenizer", ""])
def test_processes_that_run_no_model_do_not_import_torch(command):
    """The launcher, `status`, a gateway and the tokenizer service build only their own
    subcommand: torch (2 s, ~200 MiB) is left to the workers and the benchmarks."""
    code = ("import sys\n"
            "from pdserve.cli import build_parser\n"
            f"build_parser({command!r})\n"
            "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_a_worker_still_gets_its_flags():
    from pdserve.cli import build_parser

    args = build_parser("decode").parse_args(["decode", "--kv-transport", "grpc"])
    assert args.command == "decode" and args.kv_transport == "grpc"
    with pytest.raises(SystemExit):  # another subcommand is named, not built
        build_parser("decode").parse_args(["gateway", "--redis-url", "redis://x"])
