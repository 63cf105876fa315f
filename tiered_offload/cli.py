"""The ``tiered-offload`` command line (also ``python -m tiered_offload``)."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
from pathlib import Path

from offload_core.errors import CheckpointError, ConfigError, DiskFullError, TieredOffloadError

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiered-offload",
        description="Train PyTorch models whose training state is larger than GPU memory and host RAM.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine decides")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    b = sub.add_parser("bench-io", help="measure a directory's disk throughput and recommend I/O settings",
                       description="Measure sequential read and write throughput of a directory for each backend, "
                                   "request size and thread count; verify the data; recommend the best settings.")
    b.add_argument("--path", action="append",
                   help="directory to test (default: a temporary directory under the current one); once per "
                        "drive a store stripes over: each measured alone, then all together, striped as the "
                        "store stripes them (their saved entry tunes and plans such a store)")
    b.add_argument("--size", default="512MiB", help="test file size per configuration and directory (default 512MiB; "
                                                    "several --path together: their number x it, twice in memory)")
    b.add_argument("--request-sizes", default="1MiB,4MiB,16MiB", help="comma-separated request sizes")
    b.add_argument("--threads", default="1,4,8", help="comma-separated I/O thread counts")
    b.add_argument("--backends", default="posix-direct,posix-buffered,aiofiles,kvikio",
                   help="comma-separated modes: posix-direct, posix-buffered, aiofiles, kvikio")
    b.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    b.add_argument("--plot", metavar="FILE", help="draw throughput against request size as a PNG")
    b.add_argument("--save-profile", nargs="?", const="", metavar="FILE",
                   help="save the recommendation as the store's I/O profile for this file system "
                        "(default ~/.config/tiered-offload/io-profile.json)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")

    d = sub.add_parser("demo", help="train a byte-level GPT whose state is several times the host budget",
                       description="Train a GPT-style byte-level model on the Python standard library's source, "
                                   "with its training state streamed through a host budget a fraction of its size.")
    d.add_argument("--d-model", type=int, default=384, help="model width (default 384)")
    d.add_argument("--layers", type=int, default=8, help="number of blocks (default 8)")
    d.add_argument("--heads", type=int, default=6, help="attention heads (default 6)")
    d.add_argument("--context", type=int, default=128, help="tokens per sequence (default 128)")
    d.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    d.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    d.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    d.add_argument("--storage", help="storage directory (default: a temporary directory under the current one)")
    d.add_argument("--host-memory", help="host budget (default: a fifth of the training state)")
    d.add_argument("--device", default="auto", help="auto, cpu or cuda")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")

    t = sub.add_parser("train", help="fine-tune a local Hugging Face model directory (resumes by default)",
                       description="Fine-tune a Hugging Face model directory with its training state streamed through "
                                   "the tiers; the same command again continues from the last committed step.")
    t.add_argument("--config", help="the run's YAML file (sections model, data, train, offload, output)")
    t.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="override a key of the YAML file (which may come first, without --config)")
    t.add_argument("--dry-run", action="store_true", help="print the model, the data, the budgets, the first batch; "
                                                         "train nothing")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")

    i = sub.add_parser("inspect", help="show what a storage directory holds",
                       description="Show a storage directory's committed training state: step, tensors, sizes, "
                                   "where the bytes are, free space, a step in flight, the process holding it.")
    i.add_argument("directory")
    i.add_argument("--stripe", action="append", default=[], metavar="DIR",
                       help="another directory of a state striped over several (in order; repeat)")
    i.add_argument("--json", action="store_true", help="print JSON")

    v = sub.add_parser("verify", help="check every tensor of a storage directory against its checksum",
                       description="Read every tensor of the committed state and compare it with the checksum "
                                   "recorded when it was written. Exit status 1 if anything is damaged.")
    v.add_argument("directory")
    v.add_argument("--stripe", action="append", default=[], metavar="DIR",
                       help="another directory of a state striped over several (in order; repeat)")
    v.add_argument("--json", action="store_true", help="print JSON")

    e = sub.add_parser("export", help="write a storage directory's weights as Hugging Face safetensors",
                       description="Write the committed weights of a storage directory as sharded safetensors with "
                                   "an index (Hugging Face layout), streaming, checking every checksum.")
    e.add_argument("directory")
    e.add_argument("--stripe", action="append", default=[], metavar="DIR",
                       help="another directory of a state striped over several (in order; repeat)")
    e.add_argument("out")
    e.add_argument("--max-shard-size", default="2GB", help="largest shard (default 2GB)")
    e.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="the weights' dtype in the files (default fp32, as trained; bf16 halves them)")
    e.add_argument("--adapter-only", action="store_true",
                   help="a PEFT run: its adapter alone (adapter_model.safetensors, adapter_config.json), for "
                        "PeftModel.from_pretrained")
    e.add_argument("--merged", action="store_true",
                   help="a PEFT run: the model with its adapter merged into the weights (as PEFT's "
                        "merge_and_unload() saves it, with the base model's config.json), for from_pretrained; "
                        "streamed, one unit in memory at a time")
    e.add_argument("--tokenizer", metavar="MODEL_DIR",
                   help="copy the tokenizer's files (tokenizer.json, tokenizer_config.json, ..., "
                        "generation_config.json) from this model directory (the one trained from; or its Hugging Face "
                        "Hub id), so that OUT is a complete model directory, as the train command's exports are")
    return parser


class _Named(logging.Formatter):
    """The command's log lines name their logger; a message the library begins with ``tiered-offload:``
    (for programs that log it their own way) loses that prefix here, where it would say it twice."""

    def formatMessage(self, record):
        record.message = record.message.removeprefix("tiered-offload: ")
        return super().formatMessage(record)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a reported error)."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "train":  # (overrides either side of the flags: `train run.yaml --dry-run a.b=1`)
        args.overrides += [a for a in rest if not a.startswith("-")]
        rest = [a for a in rest if a.startswith("-")]
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    handler = logging.StreamHandler()  # (basicConfig leaves a root logger that has handlers alone)
    handler.setFormatter(_Named("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, handlers=[handler])
    try:
        if args.command == "bench-io":
            from tiered_offload.bench_io import main as bench_main
            return bench_main(args)
        if args.command == "demo":
            from tiered_offload_examples.demo import main as demo_main
            return demo_main(args)
        if args.command in ("inspect", "verify", "export"):
            return _state_command(args)
        if args.command == "train":
            from tiered_offload.train import train
            config, overrides = args.config, list(args.overrides)
            if config is None and overrides and "=" not in overrides[0]:
                config = overrides.pop(0)  # `tiered-offload train run.yaml ...`, as other fine-tuning commands take it
            summary = train(config, overrides, dry_run=args.dry_run, progress=not args.no_progress)
            if os.environ.get("RANK", "0") != "0":  # (under torchrun: rank 0 says it)
                return 0
            if summary.get("stopped"):
                print(f"stopped at step {summary['step']} (committed); run the same command to continue")
            elif not args.dry_run:
                print(f"trained to step {summary['step']}; the model is in {summary['final']}")
            return 0
    except TieredOffloadError as e:
        print(f"tiered-offload {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    raise AssertionError(f"unhandled command {args.command}")


def _state_command(args) -> int:
    import json

    from offload_core.sizes import format_size
    from tiered_offload.checkpoint.state_dir import open_state
    from tiered_offload import progress
    with open_state(args.directory, stripes=args.stripe, live=args.command == "inspect") as sd, \
            progress.shown(not getattr(args, "json", False)):
        if args.command == "export":
            return _export(sd, args)
        if args.command == "verify":
            with progress.counter(None, desc="verifying") as advance:
                report = sd.verify(advance)
            if args.json:
                print(json.dumps(report, indent=1))
            else:
                print(f"{report['directory']}: step {report['step']}, {report['tensors_checked']} tensors, "
                      f"{format_size(report['bytes_checked'])} checked")
                for bad in report["damaged"]:
                    print(f"DAMAGED {bad['tensor']} in {bad['file']}: {bad['problem']}")
                print("OK: every tensor matches its checksum" if report["ok"] else
                      f"{len(report['damaged'])} damaged tensor(s): restore them from a copy of the directory")
            return 0 if report["ok"] else 1
        info = sd.inspect()
        if args.json:
            print(json.dumps(info, indent=1))
            return 0
        print(f"{info['directory']}")
        for r in info.get("ranks", []):  # the shared root of a sharded run
            print(f"  rank {r['rank']} of {len(info['ranks'])}   step {r['step']}"
                  + (f" (step {r['step_in_flight']['step']} in flight)" if r["step_in_flight"] else "")
                  + (f" (step {r['previous_commit_step']}'s commit kept)" if r.get("previous_commit_step") is not None
                     else "")
                  + f"  {r['directory']}")
        print(f"  step            {info['step']}" + (f"  (step {info['step_in_flight']['step']} in flight: "
                                                      f"{info['step_in_flight']['units_recorded']}/"
                                                      f"{info['step_in_flight']['units']} units written; "
                                                      f"{'its engine is writing it' if info['lock_holder'] else 'a resume finishes it'})"
                                                      if info["step_in_flight"] else ""))
        print(f"  parameters      {info['parameter_count']:,} in {info['parameters']} tensors, {len(info['units'])} units")
        print(f"  optimizer       {info['optimizer']['class']} (states: {', '.join(info['optimizer']['states']) or 'none'})"
              f", lr {info['learning_rate']}")
        print(f"  state on disk   {format_size(info['state_bytes'])} in {info['tensors']} tensors "
              f"({info['tensors_all_zero']} all-zero, no file)")
        if info["user_state"]:
            print(f"  user state      {json.dumps(info['user_state'])}")
        holder = info["lock_holder"]
        print("  in use by       " + (f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}"
                                       if holder else "nobody"))
        if info.get("stripe_bytes"):  # (what a resume must give again)
            weights = ":".join(map(str, info["stripe_weights"] or []))
            spec = (f"posix:{','.join(d['directory'] for d in info['storage'])}?stripe_bytes={info['stripe_bytes']}"
                    + (f"&stripe_weights={weights}" if weights else ""))
            print(f"  striped         in stripes of {format_size(info['stripe_bytes'])}"
                  f"{f', by weights {weights}' if weights else ', evenly'}: resume with storage=\"{spec}\"")
        for d in info["storage"]:
            print(f"  {d['directory']}: {d['files']} files, {format_size(d['bytes'])}; "
                  f"{format_size(d['free_bytes'])} free of {format_size(d['total_bytes'])}")
            if d.get("previous_commit_bytes"):
                print(f"    {format_size(d['previous_commit_bytes'])} only the commit before the last (step "
                      f"{info['previous_commit_step']}) names: kept for the other ranks till the run's next start")
            if d["unreferenced_files"]:
                print(f"    not part of the committed state (a step in flight, or leftovers a resume deletes): "
                      f"{', '.join(d['unreferenced_files'][:5])}")
        print(f"  {'unit':<14}{'params':>12}  files")
        for u in info["units"]:
            files = ", ".join(f"{k}={t['file'] or '(zero)'}" for k, t in u["tensors"].items())
            print(f"  {u['name']:<14}{u['numel']:>12,}  {files}")
        return 0


def _export(sd, args) -> int:
    """``export``: the weights, and the tokenizer's files where ``--tokenizer`` names their directory
    (checked before the weights are written; both under one hold of OUT)."""
    from tiered_offload.checkpoint.safetensors_io import TOKENIZER_FILES, copy_tokenizer, exporting, tokenizer_files
    source = _tokenizer_dir(args.tokenizer) if args.tokenizer else None
    if source is not None and not tokenizer_files(source):
        raise ConfigError(f"--tokenizer {source}: " + (
            f"no tokenizer file there (looked for {', '.join(TOKENIZER_FILES)}); name the model directory the run "
            f"was trained from" if source.is_dir() else "no such directory; name the model directory the run was "
                                                         "trained from") + ". Nothing was exported")
    out = Path(args.out)
    with exporting(out):
        files = sd.export(out, args.max_shard_size, args.dtype, adapter_only=args.adapter_only, merged=args.merged)
        if source is not None:
            try:
                files += copy_tokenizer(source, out)
            except OSError as e:
                message = (f"{out}: the weights are exported, and the tokenizer's files are not ({e.filename}: "
                           f"{e.strerror or e}); free space there and export again, or copy them from {source}")
                raise (DiskFullError(message, path=str(out)) if e.errno in (errno.ENOSPC, errno.EDQUOT)
                       else CheckpointError(message)) from None
    for f in files:
        print(f)
    if source is None and (out / "config.json").is_file():
        print(f"note: {out} has no tokenizer; add --tokenizer MODEL_DIR to copy it from the model directory "
              f"trained from", file=sys.stderr)
    return 0


def _tokenizer_dir(given: str) -> Path:
    """The directory ``--tokenizer`` names: a local one, or a Hub id's snapshot in huggingface_hub's cache
    (its tokenizer's files fetched there if missing), as train's ``model.path`` reads one."""
    source = Path(given).expanduser()
    if source.exists():
        return source
    from tiered_offload.train.run import hub_model
    named = hub_model(given)
    if named is None:
        return source
    from tiered_offload.checkpoint.safetensors_io import TOKENIZER_FILES
    from tiered_offload.train.sources import first_line
    try:
        import huggingface_hub
        return Path(huggingface_hub.snapshot_download(named[0], revision=named[1], allow_patterns=list(TOKENIZER_FILES),
                                                      ignore_patterns=["*/*"]))
    except Exception as e:  # noqa: BLE001 - (no network, not cached, no such repository, gated, no huggingface_hub)
        raise ConfigError(f"--tokenizer {given} is not a local directory, and the Hugging Face Hub gave no model of "
                          f"that id ({type(e).__name__}: {first_line(e)}); name the model directory the run was "
                          f"trained from. Nothing was exported") from None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
