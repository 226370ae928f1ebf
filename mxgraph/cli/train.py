"""`mxgraph train`: train a preset or Hugging Face model on this process, or on several
under torchrun (`--nproc`, `--max-restarts`, `--nnodes`); its flags are `TrainConfig`'s
fields plus the launcher's.

    mxgraph train --model llama-20m --steps 100
    mxgraph train --model llama-20m --plan plan.toml --nproc 4 --save-every 50
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

from mxgraph.errors import PlanError, UserError
from mxgraph.train.config import TrainConfig
from mxgraph.train.model_spec import ModelSpec, resolve_model


def add_train_parser(commands, parents) -> None:
    """Register `train` on the CLI's subparsers."""
    train = commands.add_parser("train", help="train a preset or Hugging Face model on the CPU or GPUs",
                                parents=parents,
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
