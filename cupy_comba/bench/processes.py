"""A/B runs of settings that must not share a process (an environment variable read at import, another tree of
the library): ``benchmarks/prefill_launches.py`` and ``benchmarks/prefill_ring.py``."""

import argparse
import contextlib
import json
import subprocess
import sys

from .suite import environment


def alternate(commands, rounds, key):
    """Run every command of ``commands`` (``{value: (argv, env, cwd)}``) once a round, in order, for ``rounds``
    rounds, each in its own process, whose last line of output is a JSON object of times; returns
    ``[{key: value, "us": times}, ...]`` in the order run, printing each."""
    runs = []
    for _ in range(rounds):
        for value, (argv, env, cwd) in commands.items():
            done = subprocess.run(argv, env=env, cwd=cwd, check=True, capture_output=True, text=True)
            runs.append({key: value, "us": json.loads(done.stdout.strip().splitlines()[-1])})
            print(f"{value!s:14s}", json.dumps(runs[-1]["us"]), flush=True)
    return runs


def main(measure, commands, key, rounds_help):
    """A benchmark script's command line: ``--worker`` prints ``measure()`` as JSON (the commands run the script
    so); otherwise ``alternate`` over ``commands()`` (a context manager yielding them, given the script's argv),
    with ``--rounds`` and ``--json`` (``{"environment", "runs"}``)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2, help=rounds_help)
    ap.add_argument("--json", metavar="JSON")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(measure()), flush=True)
        return
    with commands() as cmds:
        runs = alternate(cmds, a.rounds, key)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"environment": environment(), "runs": runs}, f, indent=1)


@contextlib.contextmanager
def same_tree(script, envs):
    """``commands`` for ``main``: ``script --worker`` in this tree under each of ``envs`` (``{value: env}``)."""
    yield {value: ([sys.executable, script, "--worker"], env, None) for value, env in envs.items()}
