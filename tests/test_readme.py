"""The README's code example, run exactly as shown under several plans (the `plan = ...`
line swapped), against the same steps done eagerly on one process: the last training loss
and the validation loss within 1e-4 relative (fp32, after 3 AdamW steps)."""
import re
from pathlib import Path

import pytest
import torch

import models
from tests.distributed import run_ranks

README = Path(__file__).resolve().parent.parent / "README.md"
PLAN_LINE = re.compile(r"^plan = mx\.Plan\(\).*$", re.M)


def example() -> str:
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    assert PLAN_LINE.search(code), "the README example must build its plan on one line"
    return code


def eager_reference():
    """The example's steps on the model itself: (last loss, validation loss)."""
    torch.manual_seed(0)
    model = models.build_model("llama-tiny")
    tokens = torch.randint(0, 256, (8, 64))
    targets = torch.roll(tokens, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(3):
        loss = model(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        return loss.detach(), model(tokens, targets)


def run_example(rank, world, plans):
    expected_loss, expected_val = eager_reference()
    for plan in plans:
        torch.manual_seed(0)  # the example draws the model and the batch: the same on every rank
        namespace: dict = {}
        exec(PLAN_LINE.sub(f"plan = mx.{plan}", example()), namespace)  # noqa: S102
        for name, expected in (("loss", expected_loss), ("val", expected_val)):
            got = namespace[name]
            err = ((got - expected).abs() / expected.abs()).item()
            assert err <= 1e-4, f"{plan}: {name} {got.item():.6f} vs eager {expected.item():.6f}"


def test_readme_example_on_one_process():
    run_example(0, 1, ["Plan()", "Plan(fusion=True, recompute='full')",
                       "Plan(micro_batches=2)"])


@pytest.mark.parametrize("plans", [
    ["Plan(tp=2)", "Plan(tp=2, sequence_parallel=True, overlap=True)",
     "Plan(zero1=True, bucket_mb=0.5, overlap=True)",
     "Plan(cp=2)", "Plan(pp=2, micro_batches=2)"],
])
def test_readme_example_on_two_ranks(plans):
    run_ranks(2, run_example, plans)


def test_example_reference_is_not_the_initial_loss():
    """The comparison is meaningful: three steps moved the loss."""
    torch.manual_seed(0)
    model = models.build_model("llama-tiny")
    tokens = torch.randint(0, 256, (8, 64))
    first = model(tokens, torch.roll(tokens, -1, dims=1))
    last, _ = eager_reference()
    assert abs(first.item() - last.item()) > 1e-2


def test_what_is_here_names_paths_that_exist():
    """Every path the README's "What is here" table names exists in the tree."""
    text = README.read_text()
    table = text[text.index("## What is here"):text.index("\nBuilt so far:")]
    rows = [line.split("|")[2] for line in table.splitlines() if line.startswith("| ") and "`" in line]
    paths = [p for row in rows for p in re.findall(r"`([^`]+)`", row)]
    assert len(paths) > 20
    root = README.parent
    assert [p for p in paths if not (root / p).exists()] == []
