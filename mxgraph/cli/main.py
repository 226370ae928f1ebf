"""The `mxgraph` command line.

A user error (`mxgraph.errors.UserError`: a bad plan, model, data file or flag value) is
printed as one line `mxgraph: error: ...` and exits with status 2; `--debug` shows its
traceback instead. Any other exception is a bug and keeps its traceback (status 1).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import traceback

import models
from mxgraph.cli.data import add_data_parser
from mxgraph.cli.search import add_search_parser
from mxgraph.errors import PlanError, UserError
from mxgraph.train.config import TrainConfig
from mxgraph.train.model_spec import ModelSpec, resolve_model

USER_ERRORS = (UserError, models.UnknownPresetError)
DEBUG_HELP = "show the full traceback of a user error instead of one line"


class _CommandParser(argparse.ArgumentParser):
    """The parser of one command: an error in its flags is one line that points to its
    --help (its usage, one line per few flags, would bury the message), and a flag it does
    not know is its error, not the top level's."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def parse_known_args(self, args=None, namespace=None):
        namespace, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return namespace, extra


def _add_dataclass_flags(parser: argparse.ArgumentParser, cls) -> None:
    """One flag per field, its help taken from the field's docstring in the source."""
    docs = _field_docs(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", help=docs.get(f.name, ""))
            continue
        kind = {"int": int, "float": float}.get(str(f.type).split(" |")[0], str)
        parser.add_argument(flag, type=kind, default=f.default, help=docs.get(f.name, ""))


def _field_docs(cls) -> dict[str, str]:
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for stmt, following in zip(body, body[1:], strict=False):
        if isinstance(stmt, ast.AnnAssign) and isinstance(following, ast.Expr) and \
                isinstance(following.value, ast.Constant):
            docs[stmt.target.id] = " ".join(str(following.value.value).split())
    return docs


LAUNCH_FLAGS = ("--nproc", "--max-restarts", "--nnodes", "--rdzv-endpoint", "--rdzv-id")
"""Flags of the launcher (torchrun), not of the training workers it starts."""


def without_launch_flags(argv: list[str]) -> list[str]:
    """The same command line without the launcher's flags (`--nproc N`, `--nproc=N`,
    `--max-restarts`, ...), for the workers torchrun starts."""
    kept, skip = [], False
    for arg in argv:
        if skip or ("=" in arg and arg.split("=")[0] in LAUNCH_FLAGS):
            skip = False
            continue
        skip = arg in LAUNCH_FLAGS
        if not skip:
            kept.append(arg)
    return kept


def torchrun_command(args, argv: list[str]) -> list[str]:
    """The torchrun command line that runs `mxgraph train` with `argv` (the launcher's
    flags removed) under args' process count, restarts and rendezvous."""
    if args.rdzv_endpoint:
        rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}",
                      f"--rdzv-id={args.rdzv_id or 'mxgraph'}", f"--nnodes={args.nnodes}"]
    elif args.nnodes != "1":
        raise UserError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (where the "
                        f"nodes meet), and the same --rdzv-id on every node")
    else:
        rendezvous = ["--standalone"]
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous,
            f"--nproc-per-node={args.nproc}", f"--max-restarts={args.max_restarts}",
            "-m", "mxgraph.cli"] + without_launch_flags(argv)


def check_train_inputs(args) -> None:
    """UserError for a bad model, plan, data file or dtype before anything is built (or
    torchrun starts processes), so that a mistake costs no model construction."""

    from mxgraph.plan import Plan, require_built
    from mxgraph.train.precision import plan_with_precision
    spec = check_model(args)
    plan = plan_with_precision(Plan.from_toml(args.plan) if args.plan else Plan(),
                               args.precision, args.dtype, args.eager, args.plan)
    world_size = args.nproc if args.nproc > 1 else int(os.environ.get("WORLD_SIZE", "1"))
    if not args.eager:  # the compiled step lays the plan out on the processes
        try:
            plan.validate(world_size=world_size)
        except PlanError as error:
            raise PlanError(f"{args.plan or 'the default plan'} on {world_size} process(es): "
                            f"{error} (--nproc N starts N)") from None
        require_built(plan)
    if args.save_every or args.resume:
        from mxgraph.train.checkpoints import check_checkpoint_dir
        check_checkpoint_dir(args.checkpoint_dir)
    if args.monitor_level not in (0, 1, 2):
        raise UserError(f"--monitor-level {args.monitor_level} is not a level; use 0 (step "
                        f"sections), 1 (+ layers and collectives) or 2 (+ ops)")
    if args.monitor_every < 1:
        raise UserError(f"--monitor-every {args.monitor_every} must be 1 or more (steps)")
    if args.max_restarts < 0:
        raise UserError(f"--max-restarts {args.max_restarts} must be 0 or more")
    from mxgraph.train.loop import nonfinite_guard
    nonfinite_guard(args)  # a UserError for a bad policy or limit
    from mxgraph.train.metrics import check_metrics_flags
    check_metrics_flags(args)  # --eval-every, --log-every, --report-to, --device-profile
    if args.max_restarts and not args.save_every:
        print("mxgraph: warning: --max-restarts without --save-every N: a restart starts "
              "again at step 0", file=sys.stderr)
    from mxgraph.data.training_data import check_training_data
    # last (it may read all the data): outside torchrun's workers the token file is made
    # here, before any worker starts
    check_training_data(args.data, args.tokenizer, args.data_field, args.model,
                        spec.vocab_size, args.batch_size, args.seq_len,
                        prepare="LOCAL_RANK" not in os.environ, progress=not args.no_progress)


def check_model(args) -> ModelSpec:
    """`--model` resolved for train (`resolve_model`: UserError for a kind train does not
    take, an unknown preset, a --model-config key or value a preset's config rejects), and
    for a Hugging Face model its config made (UserError for a directory without weights, an
    unknown model_type or config file, a missing transformers, an override the config
    rejects, a --seq-len beyond its positions); only configs are made, no model."""
    from mxgraph.hf.pretrained import weight_files
    spec = resolve_model(args.model, args.model_config, command="train")
    if spec.kind == "pretrained":
        weight_files(spec.directory)  # a UserError for a directory without weights
    if spec.is_hf:
        positions = getattr(spec.hf_config(), "max_position_embeddings", None)
        if isinstance(positions, int) and args.seq_len > positions:
            raise UserError(f"--seq-len {args.seq_len} is longer than {args.model}'s "
                            f"max_position_embeddings={positions}; raise it with --model-config "
                            f"max_position_embeddings={args.seq_len}")
    return spec


def _train(args) -> int:
    check_train_inputs(args)
    if args.nproc > 1 or args.max_restarts > 0 or args.rdzv_endpoint:
        return _launch(args)
    from mxgraph.runtime.cluster.launch import close_process_group
    from mxgraph.runtime.health import NonFiniteError
    from mxgraph.train.loop import log_to_console, train
    from mxgraph.train.metrics import format_mfu
    log_to_console()
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})
    try:
        result = train(cfg, progress=not args.no_progress)
    except NonFiniteError as error:
        stop_file = os.environ.get(STOP_FILE)
        if not stop_file:
            raise
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # every node's launcher says it
            with open(stop_file, "w") as f:
                f.write(str(error))
        close_process_group()
        return 0  # a policy's stop: the launcher reports it (torchrun would restart a failure)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"train loss {result['train_loss']:.4f} | validation loss "
              f"{result['val_loss']:.4f} nats/token | {result['tokens_per_s']:,.0f} tokens/s | "
              f"{format_mfu(result['mfu'])} | {result['seconds']:.1f} s")
        if args.profile:
            print(f"profiler traces (one per rank): {args.profile}/rank*.json; read them with "
                  f"mxgraph inspect --overlap {args.profile}")
    close_process_group()  # under torchrun: every rank ends its groups before exiting
    return 0


STOP_FILE = "MXGRAPH_STOP_FILE"
"""Set by the launcher for its workers: where local rank 0 writes why the non-finite policy
stopped the run; the workers then exit 0, so that torchrun does not restart them."""


def _launch(args) -> int:
    """Run the training workers under torchrun; a stop by --on-nonfinite is one error line
    and status 2, as on one process."""
    import tempfile

    from mxgraph.runtime.health import NonFiniteError
    with tempfile.TemporaryDirectory(prefix="mxgraph-launch-") as folder:
        stop_file = os.path.join(folder, "stopped")
        status = subprocess.call(torchrun_command(args, sys.argv[1:]),
                                 env={**os.environ, STOP_FILE: stop_file})
        if os.path.exists(stop_file):
            with open(stop_file) as f:
                raise NonFiniteError(f.read())
    return status


def _inspect(args) -> int:
    from mxgraph.cli.inspect import main as inspect_main
    return inspect_main(args)


def _export(args) -> int:
    from mxgraph.hf.export import export
    written = export(args.checkpoint, args.hf, args.max_shard_size, progress=not args.no_progress)
    print(f"wrote {len(written)} files to {args.hf}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mxgraph")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    # a command's own --debug; SUPPRESS keeps it from resetting the top-level one
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help=DEBUG_HELP)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)
    train = commands.add_parser("train", help="train a preset or Hugging Face model on the CPU or GPUs",
                                parents=[debug],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_dataclass_flags(train, TrainConfig)
    train.add_argument("--nproc", type=int, default=1,
                       help="processes to start through torchrun on this node (distributed plans)")
    train.add_argument("--max-restarts", type=int, default=0,
                       help="restarts of the workers after a failure (torchrun's): each restart "
                            "resumes from the newest snapshot every rank holds in memory, else "
                            "from the newest committed checkpoint (needs --save-every N)")
    train.add_argument("--nnodes", default="1",
                       help="nodes, N or MIN:MAX (elastic: with MIN < MAX the job goes on "
                            "with fewer nodes when one does not come back, data parallelism "
                            "shrinking, if the plan leaves dp unset); needs --rdzv-endpoint")
    train.add_argument("--rdzv-endpoint", default=None,
                       help="HOST:PORT where the nodes meet (torchrun's c10d rendezvous); "
                            "default: this node alone")
    train.add_argument("--rdzv-id", default=None,
                       help="job id, the same on every node (also names the in-memory "
                            "snapshots); default: mxgraph")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(run=_train)
    inspect = commands.add_parser("inspect", parents=[debug],
                                  help="summarise a dump directory, estimate memory "
                                  "(--memory) or communication (--comm) per rank, or read "
                                  "a profiler trace's overlap (--overlap)")
    inspect.add_argument("dump_dir", nargs="?", help="directory written by Plan(dump_dir=...)")
    inspect.add_argument("--memory", action="store_true",
                         help="estimate memory per pipeline rank for --model under --plan "
                              "(meta device, nothing allocated): table + bar chart PNG")
    inspect.add_argument("--comm", action="store_true",
                         help="bytes per collective kind and parallel axis per rank and step "
                              "for --model under --plan, read from the graphs compiled on a "
                              "paper mesh (meta device, nothing runs); set dp in the plan")
    inspect.add_argument("--model", help="preset name for --memory/--comm (e.g. llama2-70b)")
    inspect.add_argument("--plan", help="plan TOML file for --memory/--comm (default: Plan())")
    inspect.add_argument("--batch-size", type=int, default=1,
                         help="micro-batch size (--memory), batch size (--comm)")
    inspect.add_argument("--seq-len", type=int, default=None,
                         help="sequence length (--memory/--comm; default: the model's "
                              "max_seq_len)")
    inspect.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                         help="parameter dtype (--memory/--comm; default: that of the plan's "
                         "precision, else bfloat16)")
    inspect.add_argument("--layers", type=int, default=None,
                         help="trace this many layers instead of the preset's (--comm)")
    inspect.add_argument("--overlap", metavar="TRACE",
                         help="communication vs compute in a profiler trace (a file, or the "
                              "directory of mxgraph train --profile DIR): per collective "
                              "kind the count, comm ms, exposed ms (compute lane idle) and "
                              "the hidden fraction; --png OUT.png draws the timeline")
    inspect.add_argument("--png", default=None,
                         help="bar chart path (--memory; default memory.png), timeline path "
                              "(--overlap; default: none)")
    inspect.add_argument("--diff", nargs=2, metavar=("PASS_A", "PASS_B"),
                         help="show which ops two passes' graphs differ in")
    inspect.set_defaults(run=_inspect)
    add_search_parser(commands, [debug], models)
    export = commands.add_parser("export", parents=[debug],
                                 help="write a checkpoint of mxgraph train as a Hugging Face "
                                      "model directory (any layout: shards are gathered)")
    export.add_argument("checkpoint", help="a committed step directory, or a --checkpoint-dir "
                                           "(its newest committed step)")
    export.add_argument("--hf", required=True, metavar="OUT",
                        help="new or empty directory for config.json, the safetensors and "
                             "the tokenizer files of the model directory the run started from")
    export.add_argument("--max-shard-size", default="5GB",
                        help="largest safetensors file (bytes, or e.g. 5GB, 500MB); more "
                             "files come with model.safetensors.index.json")
    export.add_argument("--no-progress", action="store_true", help="no progress bar")
    export.set_defaults(run=_export)
    add_data_parser(commands, [debug])
    parser.description = ("Compile and run PyTorch training steps. Commands: "
                          f"{', '.join(commands.choices)}; 'mxgraph COMMAND --help' for one.")
    return parser


def main(argv=None) -> int:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except USER_ERRORS as error:
        if args.debug:
            traceback.print_exc()
        else:
            print(f"mxgraph: error: {one_line(error)}", file=sys.stderr)
        return 2


def one_line(error: BaseException) -> str:
    """The first line of the message; the rest, if any, is left to --debug."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return lines[0] + (" (more with mxgraph --debug)" if len(lines) > 1 else "")

