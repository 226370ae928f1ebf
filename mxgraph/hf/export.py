"""`mxgraph export CHECKPOINT --hf OUT`: a checkpoint of `mxgraph train` as a Hugging Face
model directory (config.json, safetensors, the tokenizer files of the model directory the
run started from), whatever layout saved it.

Each saving rank's snapshot holds, under "rank_local"/"export" (`export_info`, written by
`train` with every checkpoint), the run's model spec, its mesh sizes and coordinates, and
every parameter's `ParamLayout`. A parameter is put together from its ranks' pieces (tp and
ep shards placed where `ParamLayout.shard` cut them; the pipeline stage that holds it) and
written straight into its safetensors file, so no more than one whole tensor (and one
piece) is in memory at a time. One process, no torch.distributed. The keys are the model's
own state-dict names (transformers 5 reads them as they are: Mixtral's fused experts too).
A preset model's state dict goes to model.safetensors with mxgraph_model.json (preset name
and --model-config). Checkpoints saved under zero1 (flat optimizer shards) are refused.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import warnings
from types import SimpleNamespace

import torch

from mxgraph.errors import UserError
from mxgraph.hf.files import CONFIG, GENERATION_CONFIG, INDEX, is_tokenizer_file, shard_names
from mxgraph.hf.models import HF_KINDS, hf_config, model_kind, parse_overrides
from mxgraph.runtime.param_layout import ParamLayout

DEFAULT_MAX_SHARD_SIZE = "5GB"
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
           torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL"}


def export_info(cfg, step_fn) -> dict:
    """What `export` needs from one rank, JSON-able: the model spec (`--model`,
    `--model-config`, its parameters' dtype as the run holds them), the mesh sizes and this rank's coordinates, the
    parameters it holds (names) and each one's layout [tp_dim, tp_blocks, ep]. `step_fn`:
    the compiled step, or the eager model."""
    paths = ("pretrained", "hf_config")  # export may run elsewhere: recorded absolute
    info = {"model": os.path.abspath(cfg.model) if model_kind(cfg.model) in paths else cfg.model,
            "model_config": cfg.model_config, "dtype": None, "mesh": None, "layouts": {},
            "zero1": False}
    model = step_fn if isinstance(step_fn, torch.nn.Module) else step_fn.model
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    info["dtype"] = str(floating[0] if floating else torch.float32).removeprefix("torch.")
    if isinstance(step_fn, torch.nn.Module):
        info["held"] = [name for name, _ in step_fn.named_parameters()]
        return info
    info["mesh"] = {"sizes": dict(step_fn.mesh.sizes), "coords": dict(step_fn.mesh.coords)}
    held = step_fn.model_parameters()
    info["held"] = [name for name, _ in held]
    info["shapes"] = {name: list(p.shape) for name, p in held}
    info["zero1"] = bool(step_fn.plan.zero1)
    if info["zero1"]:  # where each parameter lies in the flat shards the checkpoint holds
        info["buckets"] = [_bucket_info(step_fn.data_parallel, i, bucket)
                           for i, bucket in enumerate(step_fn.data_parallel.buckets)]
    info["layouts"] = {name: [layout.tp_dim, list(layout.tp_blocks or []) or None, layout.ep]
                       for name, layout in step_fn.layouts.items() if layout.sharded}
    return info


def _bucket_info(data_parallel, index: int, bucket) -> dict:
    """A ZeRO-1 bucket: its shard's name, its parameters' names and flat offsets, the shard's
    length and this rank's place in the bucket's group (which slice of the flat it holds)."""
    import torch.distributed as dist
    group = data_parallel.process_group(bucket)
    return {"shard": f"zero1.bucket{index}", "names": list(bucket.names),
            "offsets": list(bucket.offsets), "shard_numel": bucket.shard_numel,
            "group_rank": 0 if group is None else dist.get_rank(group)}


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '100KB' or a number of bytes -> bytes (powers of 1000, as HF)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", str(text).upper())
    if not match:
        raise UserError(f"--max-shard-size {text} is no size; write e.g. 5GB, 500MB or bytes")
    scale = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9}
    return int(float(match.group(1)) * scale[match.group(2)])


def committed_step(checkpoint: str) -> str:
    """The committed step directory `checkpoint` names: a step_* directory, or a
    --checkpoint-dir (its newest committed step)."""
    from mxgraph.runtime.checkpoint import disk
    if os.path.isfile(os.path.join(checkpoint, disk.METADATA)):
        return checkpoint
    steps = [path for _, path in disk.list_steps(checkpoint) if disk.is_committed(path)] \
        if os.path.isdir(checkpoint) else []
    if not steps:
        raise UserError(f"{checkpoint} is no committed checkpoint (a step_* directory with "
                        f".metadata) nor a --checkpoint-dir holding one")
    return steps[0]


class _Snapshot:
    """A committed checkpoint read one tensor at a time."""

    def __init__(self, path: str):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        from mxgraph.runtime.checkpoint import disk
        self.path, self.dcp = path, dcp
        self.metadata = FileSystemReader(path).read_metadata()
        self.ranks = []
        for rank in range(disk.saved_world_size(path)):
            key = disk.snapshot_key(rank)
            box = {key: io.BytesIO()}
            self._load(box)
            box[key].seek(0)
            skeleton = pickle.loads(box[key].read())["skeleton"]
            info = skeleton["rank_local"].get("export")
            if info is None:
                raise UserError(f"{path} was saved before checkpoints recorded what export "
                                f"needs (the model and each parameter's layout); train again "
                                f"with this mxgraph to export it")
            sharded = skeleton["rank_local"].get("sharded")
            refs = sharded["model"] if sharded else skeleton["model"]
            self.ranks.append((info, {name: ref.key for name, ref in refs.items()}))

    def read(self, key: str) -> torch.Tensor:
        tensor_md = self.metadata.state_dict_metadata[key]
        box = {key: torch.empty(tuple(tensor_md.size), dtype=tensor_md.properties.dtype)}
        self._load(box)
        return box[key]

    def _load(self, box: dict) -> None:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            self.dcp.load(box, checkpoint_id=self.path, no_dist=True)

    def shape(self, key: str) -> list[int]:
        return list(self.metadata.state_dict_metadata[key].size)


def _layout(entry) -> ParamLayout:
    tp_dim, blocks, ep = entry
    return ParamLayout(tp_dim, tuple(blocks) if blocks else None, ep)


def _place(full: torch.Tensor, piece: torch.Tensor, ranges) -> None:
    """Copy `piece` into `full` where `ranges` (per dim, see `pretrained.owned_ranges`) say."""
    for dim, dim_ranges in enumerate(ranges):
        if len(dim_ranges) > 1:
            parts = piece.split([b - a for a, b in dim_ranges], dim)
            for part, r in zip(parts, dim_ranges, strict=True):
                _place(full, part, ranges[:dim] + [[r]] + ranges[dim + 1:])
            return
    full[tuple(slice(*r[0]) for r in ranges)].copy_(piece)


class _Piece:
    """A rank's piece of a parameter, saved as one tensor."""

    def __init__(self, snapshot: _Snapshot, key: str):
        self.snapshot, self.key = snapshot, key

    def shape(self) -> list[int]:
        return self.snapshot.shape(self.key)

    def dtype(self) -> torch.dtype:
        return self.snapshot.metadata.state_dict_metadata[self.key].properties.dtype

    def read(self) -> torch.Tensor:
        return self.snapshot.read(self.key)


class _Zero1Piece:
    """A rank's piece of a parameter under ZeRO-1: its range of a bucket's flat values,
    read from the shards of the ranks of the bucket's group (those with the same tp, ep,
    pp and cp coordinates and the same bucket), one shard at a time."""

    def __init__(self, snapshot: _Snapshot, info: dict, name: str):
        self.snapshot, self.info, self.name = snapshot, info, name
        self.bucket = next(b for b in info["buckets"] if name in b["names"])
        self.offset = self.bucket["offsets"][self.bucket["names"].index(name)]
        same = {axis: info["mesh"]["coords"].get(axis) for axis in ("tp", "ep", "pp", "cp")}
        self.shards = {}  # group rank -> the checkpoint key of its shard
        for other, keys in snapshot.ranks:
            coords = other["mesh"]["coords"]
            if any(coords.get(axis) != value for axis, value in same.items()):
                continue
            for bucket in other["buckets"]:
                if bucket["names"] == self.bucket["names"]:
                    self.shards.setdefault(bucket["group_rank"], keys[bucket["shard"]])

    def shape(self) -> list[int]:
        return list(self.info["shapes"][self.name])

    def dtype(self) -> torch.dtype:
        key = next(iter(self.shards.values()))
        return self.snapshot.metadata.state_dict_metadata[key].properties.dtype

    def read(self) -> torch.Tensor:
        numel, size = _numel(self.shape()), self.bucket["shard_numel"]
        flat = torch.empty(numel, dtype=self.dtype())
        start, stop = self.offset, self.offset + numel
        for group_rank in range(start // size, (stop - 1) // size + 1):
            if group_rank not in self.shards:
                raise UserError(f"{self.snapshot.path} lacks the ZeRO-1 shard {group_rank} "
                                f"of {self.bucket['shard']} holding {self.name}")
            shard = self.snapshot.read(self.shards[group_rank])
            lo, hi = max(start, group_rank * size), min(stop, (group_rank + 1) * size)
            flat[lo - start:hi - start] = shard[lo - group_rank * size:hi - group_rank * size]
        return flat.view(self.shape())


class _Gatherer:
    """Whole parameters from the ranks' pieces."""

    def __init__(self, snapshot: _Snapshot):
        self.snapshot = snapshot
        self.owners: dict[str, list[tuple[dict, object]]] = {}
        """name -> (saving rank's info, how to read its piece) per rank holding it."""
        for info, keys in snapshot.ranks:
            for name in info["held"]:
                if info["zero1"]:
                    reader = _Zero1Piece(snapshot, info, name)
                else:
                    reader = _Piece(snapshot, keys[name])
                self.owners.setdefault(name, []).append((info, reader))

    def names(self) -> list[str]:
        return list(self.owners)

    def layout(self, name: str) -> ParamLayout | None:
        info = self.owners[name][0][0]
        entry = info["layouts"].get(name)
        return _layout(entry) if entry else None

    def shape(self, name: str) -> list[int]:
        info, reader = self.owners[name][0]
        local = reader.shape()
        layout = self.layout(name)
        return layout.full_shape(local, info["mesh"]["sizes"]) if layout else local

    def dtype(self, name: str) -> torch.dtype:
        return self.owners[name][0][1].dtype()

    def whole(self, name: str) -> torch.Tensor:
        from mxgraph.hf.pretrained import owned_ranges
        layout = self.layout(name)
        if layout is None:
            return self.owners[name][0][1].read()
        full = torch.empty(self.shape(name), dtype=self.dtype(name))
        done = set()
        for info, reader in self.owners[name]:
            coords = info["mesh"]["coords"]
            where = (coords.get("tp"), coords.get("ep"))
            if where in done:
                continue
            done.add(where)
            mesh = SimpleNamespace(sizes=info["mesh"]["sizes"], coords=coords)
            _place(full, reader.read(), owned_ranges(layout, list(full.shape), mesh))
        return full


def export(checkpoint: str, out: str, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
           progress: bool = True) -> list[str]:
    """Write the committed checkpoint `checkpoint` (a step directory or a --checkpoint-dir:
    its newest) to `out` as a Hugging Face model directory (see the module docstring);
    safetensors files of at most `max_shard_size` each (bytes, or '5GB') with
    model.safetensors.index.json when there are several. Returns the files written.
    UserError for a non-empty `out` or a checkpoint saved before export was recorded."""
    limit = parse_size(max_shard_size)
    if os.path.isdir(out) and os.listdir(out):
        raise UserError(f"{out} is not empty; export into a new or empty directory")
    snapshot = _Snapshot(committed_step(checkpoint))
    info = snapshot.ranks[0][0]
    gatherer = _Gatherer(snapshot)
    names = gatherer.names()
    os.makedirs(out, exist_ok=True)
    written = _write_config(info, out)
    strip = "model." if written and written[0].endswith(CONFIG) else ""
    keys = {name: name.removeprefix(strip) for name in names}
    written += _write_safetensors(gatherer, names, keys, out, limit, progress)
    return written


def _write_config(info: dict, out: str) -> list[str]:
    """config.json (a Hugging Face model, in the run's dtype) and the tokenizer files (and
    generation config) of its directory, or mxgraph_model.json for a preset. The files
    written."""
    spec, overrides = info["model"], parse_overrides(info["model_config"])
    kind = model_kind(spec)  # train resolved it (`mxgraph.train.model_spec`): only its kind
    written = []
    if kind in HF_KINDS:
        config = hf_config(os.path.join(spec, CONFIG) if kind == "pretrained" else spec,
                           overrides)
        config.dtype = getattr(torch, info["dtype"])
        config.use_cache = True  # what the family defaults to for inference
        config.save_pretrained(out)
        written.append(os.path.join(out, CONFIG))
        if kind == "pretrained":
            for name in sorted(os.listdir(spec)):
                if is_tokenizer_file(name) or name == GENERATION_CONFIG:
                    shutil.copy(os.path.join(spec, name), os.path.join(out, name))
                    written.append(os.path.join(out, name))
    else:
        path = os.path.join(out, "mxgraph_model.json")
        with open(path, "w") as f:
            json.dump({"preset": spec, "model_config": info["model_config"],
                       "dtype": info["dtype"]}, f, indent=2)
        written.append(path)
    return written


def _write_safetensors(gatherer: _Gatherer, names: list[str], keys: dict[str, str], out: str,
                       limit: int, progress: bool) -> list[str]:
    """Stream the tensors into safetensors files (header first: shapes are known)."""
    from tqdm import tqdm
    sizes = {n: gatherer.dtype(n).itemsize * _numel(gatherer.shape(n)) for n in names}
    shards, current, total = [], [], 0
    for name in names:
        if current and total + sizes[name] > limit:
            shards.append(current)
            current, total = [], 0
        current.append(name)
        total += sizes[name]
    shards.append(current)
    files = shard_names(len(shards))
    bar = tqdm(total=len(names), unit="tensor", desc="export", disable=not progress)
    with bar:
        for file, shard in zip(files, shards, strict=True):
            header, offset = {"__metadata__": {"format": "pt"}}, 0
            for name in shard:
                header[keys[name]] = {"dtype": _DTYPES[gatherer.dtype(name)],
                                      "shape": gatherer.shape(name),
                                      "data_offsets": [offset, offset + sizes[name]]}
                offset += sizes[name]
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)
            with open(os.path.join(out, file), "wb") as f:
                f.write(len(text).to_bytes(8, "little"))
                f.write(text)
                for name in shard:
                    f.write(gatherer.whole(name).contiguous().view(torch.uint8).numpy().tobytes())
                    bar.update(1)
    paths = [os.path.join(out, file) for file in files]
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {keys[n]: file for file, shard in zip(files, shards, strict=True)
                                for n in shard}}
        path = os.path.join(out, INDEX)
        with open(path, "w") as f:
            json.dump(index, f, indent=2)
        paths.append(path)
    return paths


def _numel(shape: list[int]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count
