"""What a search is for (`Setting`): the model, the device, the job's size, and the search's
caches. A data class below everything that predicts with it (`predict.py`,
`schedule_time.py`, `enumerate.py`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from mxgraph.devices.profile import DeviceProfile
from mxgraph.search.layer_cost import TraceCache


@dataclass
class Setting:
    """What a search is for: the model, the device, the job's size."""

    config: object
    """The model config (a models config dataclass)."""
    device: DeviceProfile
    gpus: int
    global_batch: int
    """Sequences per optimizer step."""
    seq_len: int
    """Tokens per sequence."""
    library: object
    """The model library (`models`) to build configs with."""
    fp8: bool = False
    """The layers' GEMMs run in FP8 (Transformer Engine's and DeepSeek-V3's recipes: the
    embedding, LM head, attention and the rest stay bf16), priced at the profile's FP8 rate
    (`DeviceProfile.fp8_flops`); memory and communication are priced as in bf16. mxgraph's
    runtime has no FP8 GEMMs: this prices published FP8 runs, it is not a plan field."""
    mtp_layers: int = 0
    """Multi-token-prediction modules (DeepSeek-V3: 1) on the last pipeline stage, each
    priced as one more block of the last layer's kind and one more LM head and loss (its
    2d x d input projection and the shared embedding's lookup are left out). The models
    library has no MTP: this prices published runs that train with it."""
    fsdp: bool = False
    """Parameters and gradients sharded over the data-parallel ranks as FSDP / ZeRO-3 shard
    them (PyTorch FSDP's FULL_SHARD, FSDP2), each unit of `Plan.bucket_mb` bytes gathered
    before its forward and its backward and its gradients reduce-scattered, per micro-batch
    (under pp > 1 once a step, the units whole through it: `search/fsdp.py`); the plan's
    `zero1` shards the optimizer as before. mxgraph's runtime shards the optimizer only:
    this prices published FSDP runs, it is not a plan field."""
    node_dispatch: bool = False
    """The expert-parallel all-to-all sends a token once to each other node that holds one
    of its experts, where it is forwarded over the intra-node link to those experts
    (DeepEP's normal kernels, DeepSeek-V3's own dispatch): with group-limited routing that
    keeps whole expert groups in a node, to at most `topk_groups` nodes. Priced by
    `part_time.node_dispatch_share`. mxgraph's dispatcher sends one copy per expert: this
    prices published runs that used such a dispatcher, it is not a plan field."""
    attention_kernel: str = ""
    """The fused attention kernel the run uses when not the device's default: a name in
    `DeviceProfile.attention_kernels` (e.g. "fa2": FlashAttention-2, which PyTorch's SDPA ran
    on Hopper before it preferred cuDNN's), whose efficiency prices its attention. ""
    is the profile's own."""
    cache: TraceCache = None
    memory: dict = field(default_factory=dict)
    flights: dict = field(default_factory=dict)
    part_times: dict = field(default_factory=dict)
    schedules: dict = field(default_factory=dict)
    """Caches (activations, in-flight micro-batches, part times, schedules) of this search."""

    @property
    def precision(self) -> str:
        """The precision the plans are searched for, and that each plan found carries
        (`Plan.precision`, so `mxgraph train --plan` holds what was predicted): fp32 on a
        float32 device profile, else bf16-mixed (fp32 master weights and gradients, what
        users train large models in; runtime/precision.py)."""
        return "fp32" if self.device.dtype == "float32" else "bf16-mixed"

    def __post_init__(self):
        self.device = self.device.with_attention_kernel(self.attention_kernel)
        if self.cache is None:
            self.cache = TraceCache(self.library)
