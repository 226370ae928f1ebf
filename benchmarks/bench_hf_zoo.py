"""Every decoder-only causal LM of transformers, tiny, under mxgraph's plans vs eager.

For each model type of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`: the config class's defaults with
only the sizes made tiny (`hf_zoo/shrink.py`: hidden 64, 2-4 layers, 4 heads / 2 KV heads,
4 experts top-2, vocabulary 256, no dropout; nothing else changed), the eager check
(forward + backward in fp32, and that no logit depends on a later token), then one cell per
plan: 3 SGD steps compared with eager autograd (`hf_zoo/cells.py`: pass, refused, crash,
wrong, timeout). Results merge by (model type, plan) into bench_results/hf_zoo.json, so a
sweep resumes where it stopped; the end prints an architecture x plan table, totals per
plan and the failures grouped by cause.

Plans (`--plans`, comma-separated; eager always runs first, the cells need it):
  one     mx.compile(model, mx.Plan())               fusion  mx.Plan(fusion=True)
  mxmaca  torch.compile(model, backend="mxmaca")
  tp2sp   Plan(tp=2, sequence_parallel=True)          ep2     Plan(ep=2) (MoE models only)
  cp2     Plan(cp=2)                                  pp2     Plan(pp=2, schedule="1f1b", micro_batches=2)
  dp2z1   Plan(dp=2, zero1=True)                      tp2ep2  Plan(tp=2, ep=2) on 4 ranks (MoE models only)
The two-rank plans run on gloo processes (tests/distributed.py's run_ranks), several cells
per launch.

    python benchmarks/bench_hf_zoo.py --plans eager                  # the eager check of every type
    python benchmarks/bench_hf_zoo.py --sample                       # one-device plans on every type,
                                                                     # two-rank plans on SAMPLE
    python benchmarks/bench_hf_zoo.py --only llama,mixtral --plans one,tp2sp,ep2
    python benchmarks/bench_hf_zoo.py --table                        # the report of the results file
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # mxgraph, tests (run_ranks, the suite's comparison helpers)
sys.path.insert(0, str(ROOT / "benchmarks"))

import hf_zoo  # noqa: E402,F401 - sets TRITON_INTERPRET before triton is imported
from hf_zoo import report  # noqa: E402
from hf_zoo.launch import Batch, run_batches, worker_main  # noqa: E402

RESULTS = ROOT / "bench_results" / "hf_zoo.json"
ALL_PLANS = ("one", "fusion", "mxmaca", "tp2sp", "ep2", "cp2", "pp2", "dp2z1", "tp2ep2")
SAMPLE = (
    # dense, pre-norm, RoPE, SwiGLU, GQA
    "llama", "mistral", "qwen2", "qwen3", "olmo", "olmo2", "stablelm", "starcoder2", "granite", "smollm3",
    "persimmon", "opt",
    # Gemma: scaled embeddings, soft-capping, sliding + full layers
    "gemma", "gemma2", "gemma3_text", "cohere2",
    # parallel attention and MLP residual
    "phi", "gpt_neox", "gptj", "cohere", "codegen",
    # fused QKV, Conv1D, learned positions, tied embeddings; multi-query; local attention layers
    "phi3", "gpt2", "gpt_bigcode", "gpt_neo",
    # ALiBi (bloom, mpt; falcon's defaults use RoPE and multi-query)
    "bloom", "mpt", "falcon",
    # MoE without / with shared experts, group-limited routing, expert biases, all-experts bmm
    "mixtral", "qwen3_moe", "olmoe", "granitemoe", "phimoe", "dbrx", "jetmoe", "ernie4_5_moe",
    "qwen2_moe", "granitemoeshared", "glm4_moe", "deepseek_v2", "deepseek_v3", "gpt_oss", "llama4_text", "minimax",
    # multi-head latent attention
    "minicpm3",
    # hybrid linear attention, short convolutions
    "qwen3_next", "lfm2",
    # Mamba and hybrids; other recurrences
    "mamba", "mamba2", "falcon_mamba", "jamba", "falcon_h1", "bamba", "zamba2", "nemotron_h", "rwkv",
    "recurrent_gemma",
)
"""The model types the two-rank plans run on with --sample: one or more of every structure."""


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--only", help="comma-separated model types (default: every causal LM type)")
    parser.add_argument("--plans", default=",".join(ALL_PLANS),
                        help=f"comma-separated, of eager,{','.join(ALL_PLANS)} (default: all)")
    parser.add_argument("--sample", action="store_true", help="run the two-rank plans only on SAMPLE")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes at once (a two-rank one is 2)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per cell")
    parser.add_argument("--rerun", action="store_true", help="run cells the results file already has")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the results file")
    parser.add_argument("--table", action="store_true", help="print the report of the results file; run nothing")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    plans = [p for p in args.plans.split(",") if p and p != "eager"]
    unknown = [p for p in plans if p not in ALL_PLANS]
    if unknown:
        sys.exit(f"unknown plan {unknown[0]!r}; choose from eager,{','.join(ALL_PLANS)}")
    data = report.load(args.results)
    models = _model_types(args.only)
    if not args.table:
        _sweep(data, models, plans, args)
    from hf_zoo.cells import PLANS
    moe_only = [p for p, case in PLANS.items() if case.moe_only]
    print(report.markdown(data, plans or list(ALL_PLANS), models if args.only else None, moe_only))
    return 0


def _model_types(only: str | None) -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    known = list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if not only:
        return known
    chosen = [m for m in only.split(",") if m]
    missing = [m for m in chosen if m not in known]
    if missing:
        sys.exit(f"{missing[0]!r} is no model type of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    return chosen


def _sweep(data: dict, models: list[str], plans: list[str], args) -> None:
    import torch
    import transformers
    from hf_zoo.cells import PLANS
    from tqdm import tqdm
    data["versions"] = {"transformers": transformers.__version__, "torch": torch.__version__}

    def todo(model, plan):
        return args.rerun or plan not in data["cells"].get(model, {})

    def run(world, cell_list, desc):
        if not cell_list:
            return
        progress = tqdm(total=len(cell_list), desc=desc, file=sys.stderr)

        def on_result(model, plan, result):
            report.record(data, model, plan, result)
            report.save(args.results, data)
            progress.set_postfix_str(f"{model}/{plan}: {result['status']}")
            progress.update()

        jobs = max(1, args.jobs // world)
        size = -(-len(cell_list) // jobs)
        batches = [Batch(world, cell_list[i:i + size], args.timeout) for i in range(0, len(cell_list), size)]
        run_batches(batches, jobs, on_result, Path(__file__).resolve())
        progress.close()

    run(1, [(m, "eager") for m in models if todo(m, "eager")], "eager")
    ready = [m for m in models if data["cells"].get(m, {}).get("eager", {}).get("status") == "pass"]
    moe = {m for m in ready if data["cells"][m]["eager"].get("moe")}
    one_device = [(m, p) for p in plans if PLANS[p].world == 1 for m in ready if todo(m, p)]
    run(1, one_device, "one device")
    ranked = [m for m in ready if m in SAMPLE] if args.sample else ready
    two_ranks = [(m, p) for m in ranked for p in plans if PLANS[p].world == 2
                 and (m in moe or not PLANS[p].moe_only) and todo(m, p)]
    run(2, two_ranks, "two ranks")


if __name__ == "__main__":
    sys.exit(main())
