#!/usr/bin/env python3
"""Run a coverage-guided fuzz target (atheris / libFuzzer), or replay inputs through one.

    tools/fuzz/run.py TARGET [--seconds N | --runs N] [--corpus DIR] [--artifacts DIR]
    tools/fuzz/run.py TARGET --replay FILE [FILE ...]
    tools/fuzz/run.py TARGET --write-seeds

TARGET is client, peer or config (tools/fuzz/README.md says what each one checks). The fuzzer
starts from the committed seeds (tools/fuzz/corpus/TARGET) and the working corpus (--corpus,
default .fuzz/TARGET/corpus), adds what it finds new coverage with to the working corpus, and
stops at the first finding, writing the input to --artifacts (default .fuzz/TARGET/artifacts)
as crash-*, timeout-* or oom-*. Exit status 0: no finding.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TARGETS = ("client", "peer", "config")
SEEDS_DIR = os.path.join(HERE, "corpus")


def _import_target(name: str):
    if name == "client":
        import client_target as target
    elif name == "peer":
        import peer_target as target
    else:
        import config_target as target
    return target


def _seeds(name: str, target) -> dict[str, bytes]:
    if name == "client":
        import client_seeds
        return client_seeds.seeds()
    return target.seeds()


def write_seeds(name: str, target) -> str:
    directory = os.path.join(SEEDS_DIR, name)
    os.makedirs(directory, exist_ok=True)
    for old in os.listdir(directory):
        os.unlink(os.path.join(directory, old))
    for seed_name, data in sorted(_seeds(name, target).items()):
        with open(os.path.join(directory, seed_name), "wb") as f:
            f.write(data)
    return directory


def replay(target, paths: list[str]) -> int:
    """Run each file through the target, uninstrumented; print what it finds."""
    failed = 0
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        try:
            target.test_one_input(data)
        except Exception:
            failed += 1
            print(f"{path}: FINDING", file=sys.stderr)
            traceback.print_exc()
        else:
            print(f"{path}: ok ({len(data)} bytes)")
    return 1 if failed else 0


def _dictionary(name: str, target, directory: str) -> str | None:
    if name == "client":
        import client_mutator
        words = [m.encode() for m in client_mutator.METHODS if m]
    elif hasattr(target, "dictionary"):
        words = target.dictionary()
    else:
        return None
    path = os.path.join(directory, f"{name}.dict")
    with open(path, "w") as f:
        for word in words:
            f.write('"' + "".join(f"\\x{b:02x}" for b in word) + '"\n')
    return path


def fuzz(name: str, args: argparse.Namespace) -> int:
    import atheris

    work = os.path.join(REPO, ".fuzz", name)
    corpus = os.path.abspath(args.corpus or os.path.join(work, "corpus"))
    artifacts = os.path.abspath(args.artifacts or os.path.join(work, "artifacts"))
    os.makedirs(corpus, exist_ok=True)
    os.makedirs(artifacts, exist_ok=True)
    with atheris.instrument_imports(include=["mooncaked"]):
        target = _import_target(name)
    seeds = os.path.join(SEEDS_DIR, name)
    flags = [sys.argv[0], f"-artifact_prefix={artifacts}/", f"-timeout={args.timeout_s}",
             f"-rss_limit_mb={args.rss_limit_mb}", f"-max_len={args.max_len}",
             "-print_final_stats=1"]
    if args.runs is not None:
        flags.append(f"-runs={args.runs}")
    if args.seconds is not None:
        flags.append(f"-max_total_time={args.seconds}")
    if args.seed is not None:
        flags.append(f"-seed={args.seed}")
    dictionary = _dictionary(name, target, artifacts)
    if dictionary:
        flags.append(f"-dict={dictionary}")
    flags += [corpus, seeds]
    options = {}
    if name == "client":
        import client_mutator

        def mutate(data, max_size, seed):
            return client_mutator.mutate(data, max_size, seed, atheris.Mutate)
        options["custom_mutator"] = mutate
    print(f"fuzzing {name}: corpus {corpus}, seeds {seeds}, findings to {artifacts}",
          flush=True)
    atheris.Setup(flags, target.test_one_input, **options)
    atheris.Fuzz()  # exits the process: 0 when the runs or time are done, else a finding
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/fuzz/run.py", description=__doc__.split("\n")[0])
    parser.add_argument("target", choices=TARGETS)
    parser.add_argument("--seconds", type=int, help="stop after this long (default: no limit)")
    parser.add_argument("--runs", type=int, help="stop after this many inputs")
    parser.add_argument("--corpus", help="working corpus directory (default .fuzz/TARGET/corpus)")
    parser.add_argument("--artifacts", help="where findings are written "
                        "(default .fuzz/TARGET/artifacts)")
    parser.add_argument("--timeout-s", type=int, default=10,
                        help="an input running longer is a hang (default 10)")
    parser.add_argument("--rss-limit-mb", type=int, default=2048,
                        help="memory over this is a finding (default 2048)")
    parser.add_argument("--max-len", type=int, default=65536,
                        help="longest input the fuzzer makes (default 65536)")
    parser.add_argument("--seed", type=int, help="libFuzzer's random seed")
    parser.add_argument("--replay", nargs="+", metavar="FILE",
                        help="run these inputs once each, uninstrumented, and show findings")
    parser.add_argument("--write-seeds", action="store_true",
                        help="regenerate tools/fuzz/corpus/TARGET from the target's seeds")
    args = parser.parse_args(argv)
    sys.path[:0] = [HERE, REPO]
    os.environ.pop("NOTIFY_SOCKET", None)
    if args.replay:
        return replay(_import_target(args.target), args.replay)
    if args.write_seeds:
        print(write_seeds(args.target, _import_target(args.target)))
        return 0
    return fuzz(args.target, args)


if __name__ == "__main__":
    sys.exit(main())
