"""Pretrained Hugging Face weights into a training model, each rank reading only its part.

    model = mxgraph.hf.load("path/to/llama")          # config.json: no weights yet
    step = mxgraph.compile(model, plan, example=batch)
    load_weights(model, step)                         # this rank's slices, in place

`build_from_dir` builds the model on the meta device (no initialisation runs). Tracing
needs real tensors (torch.export fakes them from the parameters, strides included: a
zero-stride stand-in, `torch.empty(()).expand(shape)`, traces, but Inductor then asserts
those strides on the real parameters). So each parameter becomes `torch.empty(shape)`: never
written, the OS gives it no page (Linux allocates anonymous memory on first write), so it
costs address space, not resident memory. The compile cuts the sharded ones to this rank's
part (a contiguous tensor of the part's size, `param_layout.materialize`), and
`load_weights` then fills every parameter the rank holds with the slices its `ParamLayout`
owns, read lazily from the safetensors files (`safe_open(...).get_slice`), each
parameter's old tensor dropped before its slice is read, one file opened per tensor and
closed after it (so the mapped pages of one tensor at most stay resident beside the rank's
parts). Peak resident memory per rank: its parts plus the compile's own
(`benchmarks/bench_load_memory.py`). Buffers (RoPE frequencies) are computed by
transformers' own `initialize_weights`, as `from_pretrained` does for buffers a checkpoint
does not hold.

The checkpoint's keys go through the model's own conversion mapping
(`transformers.conversion_mapping.get_model_conversion_mapping`): renamings (Mixtral's
`block_sparse_moe.` -> `mlp.`) and converters that stack per-expert tensors
(`MergeModulelist`) and concatenate projections (`Concatenate`, gate and up into
`gate_up_proj`) become a tree of lazy reads, so a rank still reads only its experts and its
tensor-parallel rows of each block. Tied weights (`tie_word_embeddings`) are one parameter
under two names: whichever name the file holds is read.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from mxgraph.errors import UserError
from mxgraph.hf.files import CONFIG, HF_INSTALL_HINT, INDEX, WEIGHTS
from mxgraph.hf.models import HFCausalLM, hf_config
from mxgraph.runtime.param_layout import set_parameter


def weight_files(directory: str) -> dict[str, str]:
    """Tensor key -> the safetensors file holding it: `model.safetensors`, or the shards
    `model.safetensors.index.json` lists. UserError when the directory has neither."""
    single, index = os.path.join(directory, WEIGHTS), os.path.join(directory, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        return {key: os.path.join(directory, name) for key, name in weight_map.items()}
    if os.path.isfile(single):
        try:
            from safetensors import safe_open
        except ImportError:
            raise UserError(f"reading {single} needs the safetensors package: "
                            f"{HF_INSTALL_HINT}") from None
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise UserError(f"{directory} has no {WEIGHTS} or {INDEX}; save the model there with "
                    f"save_pretrained(DIR) (safetensors), or pass --model "
                    f"{os.path.join(directory, CONFIG)} to train it from random weights")


def load(directory: str, overrides: dict | None = None,
         dtype: torch.dtype = torch.float32) -> HFCausalLM:
    """A pretrained model directory (config.json + model.safetensors or its sharded index)
    as an `HFCausalLM` without its weights yet (meta-built, unwritten stand-ins): compile
    it, then `load_weights(model, step)` reads each rank's slices (or `load_weights(model)`
    the whole model, to run it eagerly)."""
    return build_from_dir(directory, overrides, dtype)


def build_from_dir(directory: str, overrides: dict | None = None,
                   dtype: torch.dtype = torch.float32) -> HFCausalLM:
    """The `HFCausalLM` of `directory/config.json` (with `overrides`) without its weights:
    built on the meta device, its buffers computed as transformers computes them (on the
    CPU), every parameter an unwritten `torch.empty` of `dtype` (no resident memory) until
    `load_weights`. `model.pretrained_dir` remembers where the weights are."""
    weight_files(directory)  # the UserError for a directory without weights, first
    config = hf_config(os.path.join(directory, CONFIG), overrides)  # or: no transformers
    import transformers
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for module in hf_model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device="cpu")
    with torch.no_grad():
        hf_model.initialize_weights()  # buffers; parameters are on meta (no work)
        stand_ins: dict[int, torch.nn.Parameter] = {}  # tied names share one Parameter
        for name, param in list(hf_model.named_parameters(remove_duplicate=False)):
            if id(param) not in stand_ins:
                kind = dtype if param.is_floating_point() else param.dtype
                stand_ins[id(param)] = torch.nn.Parameter(  # never written: no pages
                    torch.empty(param.shape, dtype=kind), requires_grad=param.requires_grad)
            set_parameter(hf_model, name, stand_ins[id(param)])
    hf_model.config.dtype = dtype
    model = HFCausalLM(hf_model)
    model.pretrained_dir = directory
    return model


def load_weights(model: HFCausalLM, step=None, progress: bool = False) -> None:
    """Fill the parameters this rank holds with `model.pretrained_dir`'s weights, cast to
    each parameter's dtype, in place (same `Parameter` objects: an optimizer built before
    keeps them). `step`: the compiled step after its first compile (`prepare`): only its
    `model_parameters()` are read (its pipeline stages), each only in the part its
    `step.layouts` entry gives this rank on `step.mesh`; None: the whole model (eager).
    Under zero1, call this before `step.parameters()` builds the optimizer's shards.
    UserError naming a tensor the model needs that the files lack, one the files hold that
    the model has no place for, or one whose shape differs."""
    directory = model.pretrained_dir
    files = weight_files(directory)
    sources = _sources(model.model, files)
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.model.named_buffers())
    for key in sources:
        if "model." + key not in params and key not in buffers:
            raise UserError(f"{directory}: tensor {key} has no place in "
                            f"{type(model.model).__name__} built from its config.json; was the "
                            f"file saved from another model?")
    aliases: dict[int, list[str]] = {}
    for name, param in params.items():
        aliases.setdefault(id(param), []).append(name)
    held = step.model_parameters() if step is not None else list(model.named_parameters())
    from tqdm import tqdm
    for name, param in tqdm(held, desc="loading weights", unit="tensor", disable=not progress):
        key = next((a.removeprefix("model.") for a in aliases[id(param)]
                    if a.removeprefix("model.") in sources), None)
        if key is None:
            raise UserError(f"{directory} has no tensor {name.removeprefix('model.')} "
                            f"(the model's parameter {name}); was the file saved from another "
                            f"model?")
        layout = step.layouts.get(name) if step is not None else None
        sharded = layout is not None and layout.sharded
        full = layout.full_shape(param.shape, step.mesh.sizes) if sharded else list(param.shape)
        node = sources[key]
        if list(node.shape) != full:
            raise UserError(f"{directory}: tensor {key} has shape {list(node.shape)} but the "
                            f"model built from its config.json has {full}")
        ranges = owned_ranges(layout, full, step.mesh) if sharded else [[(0, n)] for n in full]
        dtype = param.dtype
        param.data = torch.empty(0, dtype=dtype)  # the compile's part goes before the read:
        param.data = node.read(ranges).to(dtype).contiguous()  # one copy of it at a time
        param.grad = None
    with torch.no_grad():
        for key, buffer in buffers.items():
            if key in sources:  # a persistent buffer the file holds (RoPE's are recomputed)
                buffer.copy_(sources[key].read([[(0, n)] for n in buffer.shape]))


def owned_ranges(layout, full: list[int], mesh) -> list[list[tuple[int, int]]]:
    """Per dim of the whole tensor, the [start, stop) ranges this rank's part is made of,
    in order (as `ParamLayout.shard` cuts it): its experts over "ep" on dim 0, its chunk
    over "tp" on `tp_dim`, of every block of a fused projection (`tp_blocks`)."""
    ranges = [[(0, n)] for n in full]
    if layout.ep:
        n = full[0] // mesh.sizes["ep"]
        ranges[0] = [(mesh.coords["ep"] * n, (mesh.coords["ep"] + 1) * n)]
    if layout.tp_dim is not None:
        tp, rank, dim = mesh.sizes["tp"], mesh.coords["tp"], layout.tp_dim
        blocks = list(layout.tp_blocks) if layout.tp_blocks else [full[dim]]
        ranges[dim], start = [], 0
        for size in blocks:
            n = size // tp
            ranges[dim].append((start + rank * n, start + (rank + 1) * n))
            start += size
    return ranges


@dataclass
class _Leaf:
    """One tensor of a safetensors file."""

    path: str
    key: str
    shape: tuple[int, ...]

    def read(self, ranges: list[list[tuple[int, int]]]) -> torch.Tensor:
        from safetensors import safe_open
        with safe_open(self.path, framework="pt") as f:  # closed after: its pages go too
            if not self.shape:
                return f.get_tensor(self.key)
            return _read_ranges(f.get_slice(self.key), ranges)


def _read_ranges(sliced, ranges) -> torch.Tensor:
    """The tensor made of `ranges` (see `owned_ranges`) of a lazy safetensors slice."""
    for dim, dim_ranges in enumerate(ranges):
        if len(dim_ranges) > 1:
            return torch.cat([_read_ranges(sliced, ranges[:dim] + [[r]] + ranges[dim + 1:])
                              for r in dim_ranges], dim)
    return sliced[tuple(slice(*dim_ranges[0]) for dim_ranges in ranges)]


@dataclass
class _Stack:
    """Tensors of one shape stacked along a new dim (`MergeModulelist`: per-expert weights)."""

    dim: int
    parts: list

    @property
    def shape(self) -> tuple[int, ...]:
        inner = list(self.parts[0].shape)
        return tuple(inner[:self.dim] + [len(self.parts)] + inner[self.dim:])

    def read(self, ranges):
        rest = ranges[:self.dim] + ranges[self.dim + 1:]
        return torch.stack([self.parts[i].read(rest) for a, b in ranges[self.dim]
                            for i in range(a, b)], self.dim)


@dataclass
class _Concat:
    """Tensors concatenated along a dim (`Concatenate`: gate and up into gate_up)."""

    dim: int
    parts: list

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.parts[0].shape)
        shape[self.dim] = sum(p.shape[self.dim] for p in self.parts)
        return tuple(shape)

    def read(self, ranges):
        pieces = []
        for a, b in ranges[self.dim]:
            offset = 0
            for part in self.parts:
                size = part.shape[self.dim]
                lo, hi = max(a, offset), min(b, offset + size)
                if lo < hi:
                    pieces.append(part.read(ranges[:self.dim] + [[(lo - offset, hi - offset)]]
                                            + ranges[self.dim + 1:]))
                offset += size
        return torch.cat(pieces, self.dim)


def _sources(hf_model, files: dict[str, str]) -> dict:
    """The model's key (its state-dict name) -> a lazy reader of it from `files`, through
    the model's conversion mapping (renamings, then at most one converter per key)."""
    from safetensors import safe_open
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        Concatenate,
        MergeModulelist,
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )
    transforms = get_model_conversion_mapping(hf_model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(set(files.values())):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    sources: dict = {}
    groups: dict[str, tuple] = {}
    for key in sorted(files, key=dot_natural_key):
        if key not in shapes:
            raise UserError(f"{INDEX} lists {key} in {files[key]}, which does not hold it")
        target, pattern = rename_source_key(key, renamings, converters)
        leaf = _Leaf(files[key], key, shapes[key])
        if pattern is None:
            sources[target] = leaf
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        groups.setdefault(target, (converter, {}))[1].setdefault(pattern, []).append(leaf)
    for target, (converter, lists) in groups.items():
        nodes = [lists.get(p, []) for p in converter.source_patterns]
        for op in converter.operations:
            if isinstance(op, MergeModulelist):
                nodes = [_Stack(op.dim, parts) for parts in nodes]
            elif isinstance(op, Concatenate):
                nodes = [_Concat(op.dim, nodes)]
            else:
                raise UserError(f"{target}: the checkpoint's tensors go through "
                                f"{type(op).__name__}, which mxgraph's loader does not read "
                                f"in slices yet; convert the model with save_pretrained first")
        sources[target] = nodes[0]
    return sources
