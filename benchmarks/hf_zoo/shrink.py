"""`shrink(config)`: a transformers config with only its sizes made tiny, by attribute names.

Every size is found by its name (the alias table `ROLE` and the substring rules of `role()`)
and type, never by model type:

| role | names (exact, or `*part*` = contains) | tiny value |
|---|---|---|
| layers | `num_hidden_layers`, `n_layer`, ... | one per kind of layer, 2 to 4 (below) |
| width | `hidden_size`, `n_embd`, `d_model`, ...; `lru_width`, `word_embed_proj_dim`, ... | 64 |
| heads / KV heads | `num_attention_heads`, ... / `num_key_value_heads`, ... | 4 / 2 (1 stays 1: MQA) |
| head dims | `head_dim`, `v_head_dim`, `qk_nope_head_dim`, ... | 16 (`qk_rope_head_dim` 8) |
| MLP widths | `*intermediate_size*`, `*ffn*`, `d_inner`, ... (ints > 0) | 128 |
| experts / top-k | `num_experts`, `num_local_experts`, ... / `num_experts_per_tok`, ... | at most 4 / 2 |
| expert groups | `n_group` / `topk_group` | 2 / 1 (when fewer groups than all) |
| vocabulary | `*vocab*` | 256 (text special token ids mod 256) |
| positions | `max_position_embeddings`, `n_positions`, ... | at most 256 |
| windows, token budgets | `sliding_window`, `attention_chunk_size`, `index_topk`, ... | at most 8 (of 16 tokens) |
| low ranks, SSM state | `*_rank`, `*state_size*`, `*d_state*` | at most 16 |
| layer counts / periods | `first_k_dense_replace`, `num_*_layers` / `*period*` | scaled / at most 2 |
| per-layer fields | lists as long as the layer count, layer-index lists, `per_layer_config` | cut |
| dropout | `*dropout*`, `*pdrop*`, `*layerdrop*` (floats) | 0.0 |

Relations the defaults hold are kept: multi-head latent attention (`kv_lora_rank`) has as
many KV heads as heads, and `head_dim` is RoPE's part (8) or all of a query head (24); an SSM
has heads x head dim = its inner width; a class that refuses 2 KV heads gets 4.

Layers: each layer's kind is its tuple of values in the per-layer fields (`layer_types`,
`mlp_layer_types`, `no_rope_layers`, membership in `moe_layers`, ...); the first layer of each
kind is kept (up to 4 kinds, at least 2 layers), so a model with sliding and full attention,
or Mamba and attention layers, keeps both. A repeated pattern (`block_types`) keeps enough
layers for each of its kinds. Sub-configs (`text_config`, `vision_config`, DBRX's
`ffn_config`, ...) are shrunk the same way. A size the config class derives from the others
(Zamba's `attention_hidden_size` = 2 x hidden) is left to the class: the config is first
built with the primary sizes alone, and a secondary one that changed there is not set.
`OVERRIDES` holds the few sizes no name-based rule can infer, each with its reason.

Nothing else changes: `use_cache`, the attention implementation, router jitter, biases,
activations, norms, RoPE parameters and every flag keep the class defaults.
"""
from __future__ import annotations

import math
import re

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, ROPE_HEAD_DIM = 64, 4, 2, 16, 8
MLP, EXPERTS, TOP_K, VOCAB, POSITIONS, WINDOW, RANK = 128, 4, 2, 256, 256, 8, 16
MIN_LAYERS, MAX_LAYERS = 2, 4

ROLE = {
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers",
                     "num_decoder_layers", "num_blocks"), "layers"),
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "emb_dim", "embedding_dim"), "hidden"),
    **dict.fromkeys(("embedding_size", "word_embed_proj_dim", "lru_width", "attention_hidden_size",
                     "backbone_hidden_size", "input_embedding_size", "output_embedding_size", "ple_embed_dim",
                     "router_hidden_size", "hidden_size_per_layer_input", "adapter_input_size",
                     "adapter_in_dim", "adapter_out_dim"),
                    "width"),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads",
                     "decoder_attention_heads"), "heads"),
    **dict.fromkeys(("swa_num_attention_heads", "index_n_heads", "linear_num_heads", "linear_num_value_heads"),
                    "other_heads"),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "kv_n_heads"), "kv_heads"),
    **dict.fromkeys(("swa_num_key_value_heads", "linear_num_key_heads", "num_query_groups", "multi_query_group_num"),
                    "other_kv_heads"),
    **dict.fromkeys(("head_dim", "attention_head_dim", "d_head", "dim_head", "kv_channels", "swa_head_dim",
                     "linear_head_dim", "linear_key_head_dim", "linear_value_head_dim", "index_head_dim",
                     "attention_head_size", "qk_nope_head_dim", "v_head_dim", "query_pre_attn_scalar"),
                    "head_dim"),
    "qk_rope_head_dim": "rope_head_dim", "qk_head_dim": "qk_head_dim", "rotary_dim": "rotary_dim",
    **dict.fromkeys(("d_inner", "dff", "dim_ff", "feed_forward_size", "n_inner", "mamba_d_ssm"), "mlp"),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
                     "zero_expert_num"), "experts"),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "moe_top_k",
                     "top_k", "num_selected_experts"), "top_k"),
    **dict.fromkeys(("n_group", "num_expert_group"), "expert_groups"),
    "topk_group": "topk_group",
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_target_positions",
                     "context_length", "max_sequence_length", "original_max_position_embeddings",
                     "model_max_length"), "positions"),
    **dict.fromkeys(("sliding_window", "attention_chunk_size", "attention_window_size", "window_size",
                     "local_attention", "sliding_window_size", "local_attention_window_len", "keep_window_size",
                     "index_topk"), "window"),
    **dict.fromkeys(("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index", "moe_layer_end_index",
                     "max_window_layers", "num_kv_shared_layers", "loop_layer_index_start",
                     "loop_layer_index_end"), "layer_count"),
    **dict.fromkeys(("layer_group_size", "n_layers_per_attn_res_block", "global_attn_every_n_layers",
                     "decoder_sparse_step", "interleave_moe_layer_step", "sliding_window_pattern",
                     "_sliding_window_pattern"), "period"),
}
"""Exact attribute names -> role; the substring rules in `role()` cover the rest."""

PRIMARY = ("layers", "hidden", "heads", "kv_heads", "mlp", "experts", "top_k", "vocab", "positions")
"""Roles set first: a size of another role that the config class derives from these (it
changes when only these change) is left to the class."""
SSM_HEADS = (("num_heads", "head_dim"), ("mamba_n_heads", "mamba_d_head"), ("mamba_num_heads", "mamba_head_dim"),
             ("n_mamba_heads", "mamba_headdim"))
"""(SSM heads, SSM head dim): where heads x dim is the inner width (expand x hidden, or
`mamba_d_ssm`) in the defaults, it stays so (Mamba-2 checks it): dim 16, heads to match."""
SSM_EXPAND = ("expand", "mamba_expand")
TEXT_TOKEN_IDS = ("pad", "bos", "eos", "sep", "cls", "unk", "mask", "eod", "decoder_start", "forced_eos",
                  "forced_bos")
"""Special token ids of the text vocabulary (`<prefix>_token_id`): they index the embedding
(padding_idx), so they shrink with it. Image, audio and video token ids stay as they are."""
OVERRIDES = {
    # the config class validates that the three loop regions (input, recurrent, output) sum to
    # the layer count: no rule by name can split 2-4 layers among them
    "dory": {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
             "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1},
    # GPT-Neo's layer pattern is [[kinds, repeats]], expanded to num_layers layers and checked
    # against it: the repeat count is a size no rule by name can find
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # the loop starts after the first layer at a multiple of n_layers_per_attn_res_block and
    # ends before the last: 3 layers, blocks of 1, the middle one looped
    "inkling2_loop_text": {"num_hidden_layers": 3, "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding"],
                           "n_layers_per_attn_res_block": 1, "loop_layer_index_start": 1,
                           "loop_layer_index_end": 2},
    # the config rounds hidden x qk_dim_factor up to a multiple of 64 for the head size, the
    # recurrent state does not: hidden 64 x 0.5 = 32 makes them differ (128 x 0.5 = 64 does not)
    "xlstm": {"hidden_size": 128, "embedding_dim": 128},
    # the hybrid layers share one transformer block; transformers ties the 2nd and later to the
    # 1st and fails with a single hybrid layer: keep two
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    "zamba2": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
               "hybrid_layer_ids": [1, 2]},
}
"""Per model type: sizes no rule by name can infer (each with the reason)."""


def role(name: str, value) -> str | None:
    """The size role of attribute `name` with default `value`, or None (not a size)."""
    if isinstance(value, bool):
        return None
    if name in ROLE:
        return ROLE[name]
    if isinstance(value, float) and re.search(r"dropout|pdrop|layerdrop|drop_prob", name):
        return "dropout"
    if not (_is_int(value) or (isinstance(value, list) and value and all(_is_int(v) for v in value))):
        return None
    if "vocab" in name:
        return "vocab"
    if re.search(r"intermediate_size|ffn", name) and not re.search(r"factor|multiple|round", name):
        return "mlp"
    if name.endswith("_token_id") and name[:-len("_token_id")] in TEXT_TOKEN_IDS:
        return "token_id"
    if re.search(r"(^|_)(low)?rank$|lora_rank", name) or re.search(r"state_size|d_state", name):
        return "small"
    if re.fullmatch(r"(num|n)_\w*layers", name):
        return "layer_count"
    if re.search(r"period|interval", name):
        return "period"
    if "_offset" in name:
        return "offset"
    return None


def shrink(config):
    """`config` (a transformers config, e.g. `CONFIG_MAPPING[t]()`) with every size tiny.

    The result is built by `type(config)` from the fields where `config` differs from its
    class's defaults, with the sizes replaced (see the module docstring)."""
    cls = type(config)
    fields = {k: _attribute(config, k, v) for k, v in config.to_dict().items()}
    default = _class_defaults(cls)
    custom = {k: v for k, v in fields.items()
              if k not in config.sub_configs and not k.startswith("_") and (k not in default or default[k] != v)}
    changes = size_changes(config, fields)
    changes.update(OVERRIDES.get(getattr(config, "model_type", ""), {}))
    for name in config.sub_configs:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            changes[name] = shrink(sub)
    primary = {k: v for k, v in changes.items()
               if k in config.sub_configs or isinstance(v, (list, dict)) or role(k, fields.get(k)) in PRIMARY}
    serialized = config.to_dict()
    try:
        first = cls(**{**custom, **primary}).to_dict()
    except Exception:  # noqa: BLE001 - then nothing counts as derived
        first = serialized
    kept = {k: v for k, v in changes.items() if k in primary or first.get(k) == serialized.get(k)}
    try:
        return cls(**{**custom, **kept})
    except Exception:
        kv_name = next((k for k in kept if ROLE.get(k) == "kv_heads" and kept[k] == KV_HEADS), None)
        if kv_name is None:
            raise
        return cls(**{**custom, **kept, kv_name: HEADS})  # the class wants as many KV heads as heads


def _attribute(config, name: str, serialized):
    """The attribute as the model reads it (Dory's layer_types differ from their serialized
    form), or the serialized value where the config refuses a global read (per-layer fields)
    or holds another type (`per_layer_config`'s view)."""
    try:
        value = getattr(config, name, serialized)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError
        return serialized
    return value if serialized is None or type(value) is type(serialized) else serialized


def _class_defaults(cls) -> dict:
    try:
        return cls().to_dict()
    except Exception:  # noqa: BLE001 - a sub-config class may need arguments
        return {}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def size_changes(config, fields: dict) -> dict:
    """{attribute: tiny value} for the sizes among `fields` (the config's attributes)."""
    layers_name = next((k for k in fields if ROLE.get(k) == "layers" and _is_int(fields[k])), None)
    num_layers = getattr(config, "num_hidden_layers", None) if layers_name is None else fields[layers_name]
    kept = _kept_layers(fields, num_layers) if _is_int(num_layers) else None
    shape = {"num_layers": num_layers, "kept": kept, "new_layers": len(kept) if kept else MIN_LAYERS,
             "old_head_dim": _old_head_dim(fields), "mla": "kv_lora_rank" in fields}
    changes = {}
    for name, value in fields.items():
        if name in config.sub_configs or value is None:
            continue
        kind = role(name, value)
        if kind is None and kept and _is_per_layer_dict(value, num_layers):
            changes[name] = _cut_per_layer_dict(value, fields, shape)
            continue
        if kind is None and kept and _is_layer_index_list(name, value, num_layers):
            kind = "layer_indices"
        elif kind is None and kept and isinstance(value, list) and (len(value) == num_layers or
                                                                   _is_layer_pattern(name, value, num_layers)):
            kind = "per_layer"
        new = _tiny(kind, name, value, fields, shape)
        if new is not None and new != value:
            changes[name] = new
    changes.update(_ssm_widths(fields))
    return changes


def _tiny(kind, name, value, fields, shape):
    """The tiny value of one attribute of role `kind` (None: unchanged)."""
    each = (lambda f: [f(v) for v in value]) if isinstance(value, list) else (lambda f: f(value))
    num_layers, kept, new_layers = shape["num_layers"], shape["kept"], shape["new_layers"]
    fixed = {"layers": new_layers, "hidden": HIDDEN, "width": HIDDEN, "heads": HEADS, "other_heads": HEADS,
             "rope_head_dim": ROPE_HEAD_DIM, "qk_head_dim": HEAD_DIM + ROPE_HEAD_DIM, "dropout": 0.0}
    if kind in fixed:
        return fixed[kind]
    if kind == "kv_heads":  # MLA computes K and V for every head from its latent
        return HEADS if shape["mla"] else each(lambda v: 1 if v == 1 else KV_HEADS)
    if kind == "other_kv_heads":
        return each(lambda v: 1 if v == 1 else KV_HEADS)
    if kind == "head_dim":
        if name == "head_dim" and _is_int(fields.get("qk_rope_head_dim")):  # MLA: RoPE's part, or all
            return ROPE_HEAD_DIM if value == fields["qk_rope_head_dim"] else HEAD_DIM + ROPE_HEAD_DIM
        return HEAD_DIM
    if kind == "rotary_dim" and shape["old_head_dim"]:  # a fraction of the head
        return max(2, 2 * round(value * HEAD_DIM / shape["old_head_dim"] / 2))
    if kind == "mlp":
        cut = [value[i] for i in kept] if isinstance(value, list) and kept and len(value) == num_layers else value
        return [MLP if v > 0 else v for v in cut] if isinstance(cut, list) else (MLP if cut > 0 else cut)
    caps = {"experts": EXPERTS, "top_k": TOP_K, "vocab": VOCAB, "positions": POSITIONS, "window": WINDOW,
            "small": RANK}
    if kind in caps:
        return each(lambda v: min(v, caps[kind]))
    if kind == "expert_groups":
        return 2 if value > 1 else value
    if kind == "topk_group":  # group-limited routing stays limited: 1 of 2 groups
        groups = fields.get("n_group", fields.get("num_expert_group"))
        return value if not groups or groups <= 1 else (1 if value < groups else 2)
    if kind == "token_id":
        return each(lambda v: v % VOCAB)
    if kind == "layer_count" and _is_int(value) and num_layers:
        if value <= 0 or value >= num_layers:  # none, or all of them
            return value if value <= 0 else new_layers
        return max(1, min(new_layers - 1, round(value * new_layers / num_layers)))
    if kind == "period" and _is_int(value):
        return min(value, 2)
    if kind == "offset" and _is_int(value):
        period = fields.get(name.replace("offset", "period"))
        return value % min(period, 2) if _is_int(period) and period > 0 else value
    if kind == "per_layer":
        return [value[i] for i in kept] if len(value) == num_layers else value
    if kind == "layer_indices":
        return [j for j, i in enumerate(kept) if i in value]
    return None


def _is_per_layer_dict(value, num_layers) -> bool:
    """Heterogeneous layers' `per_layer_config`: {"05": {"head_dim": 512}, ...}."""
    return (isinstance(value, dict) and bool(value) and all(isinstance(v, dict) for v in value.values())
            and all(str(k).isdigit() and int(k) < num_layers for k in value))


def _cut_per_layer_dict(value: dict, fields: dict, shape: dict) -> dict:
    """The kept layers' entries, renumbered, each override's sizes made tiny by the same rules."""
    width = len(str(next(iter(value))))
    by_layer = {int(k): v for k, v in value.items()}
    out = {}
    for j, i in enumerate(shape["kept"]):
        if i in by_layer:
            out[f"{j:0{width}d}"] = {k: _tiny(role(k, v), k, v, fields, shape) if _tiny(role(k, v), k, v, fields,
                                                                                         shape) is not None else v
                                     for k, v in by_layer[i].items()}
    return out


def _is_layer_index_list(name: str, value, num_layers) -> bool:
    """A list of distinct increasing layer indices (`mlp_only_layers`, `moe_layers`, ...)."""
    return (isinstance(value, list) and _is_int(num_layers) and bool(re.search(r"layer|idx|ids", name))
            and all(_is_int(v) and 0 <= v < num_layers for v in value)
            and all(a < b for a, b in zip(value, value[1:], strict=False)))


def _is_layer_pattern(name: str, value, num_layers) -> bool:
    """A shorter list of layer kinds the model repeats over its layers (`block_types`)."""
    return (name.endswith("types") and isinstance(value, list) and 1 < len(value) < num_layers
            and all(isinstance(v, str) for v in value))


def _kept_layers(fields: dict, num_layers: int) -> list[int]:
    """The original indices of the layers kept: the first of each kind (see module docstring);
    a repeated pattern (`block_types`) keeps the layers up to its last kind's first one."""
    columns, prefix = [], 0
    for name, value in fields.items():
        if role(name, value) in ("vocab", "token_id", "small", "dropout"):
            continue
        if _is_layer_index_list(name, value, num_layers):
            columns.append([i in value for i in range(num_layers)])
        elif isinstance(value, list) and len(value) == num_layers:
            columns.append([repr(v) for v in value])
        elif _is_per_layer_dict(value, num_layers):
            columns.append([repr(value.get(k)) for k in _layer_keys(value, num_layers)])
        elif _is_layer_pattern(name, value, num_layers):
            prefix = max(prefix, max(value.index(v) for v in value) + 1)
    kinds = {}
    for i in range(num_layers):
        kinds.setdefault(tuple(column[i] for column in columns), i)
    kept = sorted(kinds.values())[:MAX_LAYERS]
    for i in range(num_layers):
        if len(kept) >= max(MIN_LAYERS, min(prefix, MAX_LAYERS)):
            break
        if i not in kept:
            kept = sorted(kept + [i])
    return kept


def _layer_keys(value: dict, num_layers: int) -> list[str]:
    width = len(str(next(iter(value))))
    return [f"{i:0{width}d}" for i in range(num_layers)]


def _old_head_dim(fields: dict) -> int | None:
    if _is_int(fields.get("head_dim")):
        return fields["head_dim"]
    hidden = next((fields[k] for k in fields if ROLE.get(k) == "hidden" and _is_int(fields[k])), None)
    heads = next((fields[k] for k in fields if ROLE.get(k) == "heads" and _is_int(fields[k])), None)
    return hidden // heads if hidden and heads else None


def _ssm_widths(fields: dict) -> dict:
    """SSM heads x head dim = inner width where the defaults have it so (see SSM_HEADS)."""
    expand = next((fields[k] for k in SSM_EXPAND if _is_int(fields.get(k))), None)
    hidden = next((fields[k] for k in fields if ROLE.get(k) == "hidden" and _is_int(fields[k])), None)
    changes = {}
    for heads_name, dim_name in SSM_HEADS:
        heads, dim = fields.get(heads_name), fields.get(dim_name)
        if not (_is_int(heads) and _is_int(dim)):
            continue
        if _is_int(fields.get("mamba_d_ssm")) and heads * dim == fields["mamba_d_ssm"]:
            inner = MLP
        elif expand and hidden and heads * dim == expand * hidden:
            inner = expand * HIDDEN
        else:
            continue
        changes[heads_name], changes[dim_name] = math.ceil(inner / HEAD_DIM), HEAD_DIM
    return changes
