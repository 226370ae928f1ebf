"""The CLI through its real entry point (`python -m mxgraph.cli`): a user error is one line
`mxgraph: error: ...` naming the fix, status 2, no traceback; `--debug` shows the
traceback; `--help` lists the commands that exist.

Every command runs in its own process (about 3 s, most of it importing torch), all of
them at once in one fixture, and each stops at its error before any training."""
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ("llama-tiny, moe-tiny, gpt-tiny, llama-20m, moe-20m, llama-1b, gpt2-124m, "
           "llama2-7b, llama2-70b, llama3-8b, mixtral-8x7b, deepseek-v3-671b")
FORMATS = ("a text file whose bytes are the tokens, or a .npy file of a 1-D integer array "
           "of token ids")

# a model whose forward returns the logits instead of the loss, trained through the real
# `mxgraph train`: the TraceError comes from mxgraph.compile's capture, not from a stub
NOT_A_LOSS = textwrap.dedent("""
    import runpy, sys, types
    import torch, models

    class Logits(torch.nn.Module):
        config = types.SimpleNamespace(vocab_size=256)

        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(256, 4)

        def forward(self, tokens, targets):
            return self.embed(tokens)

    models.build_model = lambda name, **kwargs: Logits()
    sys.argv = ["mxgraph", *sys.argv[1:]]
    runpy.run_module("mxgraph.cli", run_name="__main__")
""")

# name: (command line, the one line expected on stderr); each runs as its own process
USER_ERRORS = {
    "unknown preset": (["train", "--model", "llama-tny"],
                       "mxgraph: error: unknown model preset 'llama-tny'; did you mean "
                       f"'llama-tiny'? known presets: {PRESETS}"),
    "missing data file": (["train", "--data", "missing.txt"],
                          f"mxgraph: error: data file missing.txt does not exist; --data takes "
                          f"{FORMATS}"),
    "unreadable data file": (["train", "--data", "junk.npy"],
                             "mxgraph: error: junk.npy: not a NumPy .npy array; write the "
                             "token ids with numpy.save, or rename the file without .npy to "
                             "read its bytes as text"),
    "missing plan": (["train", "--plan", "missing.toml"],
                     "mxgraph: error: plan file missing.toml does not exist; pass the path of "
                     "a TOML file of Plan fields (e.g. a line tp = 2)"),
    "plan syntax": (["train", "--plan", "syntax.toml"],
                    "mxgraph: error: plan file syntax.toml is not valid TOML: Invalid value "
                    "(at line 1, column 5); fields are written name = value, e.g. tp = 2 or "
                    "schedule = \"1f1b\""),
    "unknown plan field": (["train", "--plan", "tpp.toml"],
                           "mxgraph: error: tpp.toml: unknown plan field 'tpp'; did you mean "
                           "'tp'?"),
    "plan field type": (["train", "--plan", "two.toml"],
                        "mxgraph: error: two.toml: tp = \"two\" is a string; tp takes an "
                        "integer"),
    "plan vs processes": (["train", "--plan", "tp2.toml"],
                          "mxgraph: error: tp2.toml on 1 process(es): world size 1 is not "
                          "divisible by tp*pp*cp = 2; launch a multiple of 2 processes or "
                          "change the axes (--nproc N starts N)"),
    "untraceable model": (["--not-a-loss", "train", "--data", "text.txt", "--steps", "1",
                           "--batch-size", "1", "--seq-len", "8", "--no-progress"],
                          "mxgraph: error: forward must return the scalar loss as one tensor; "
                          "it returned 1 output(s)"),
    "bad flag value": (["train", "--steps", "two"],
                       "mxgraph train: error: argument --steps: invalid int value: 'two' "
                       "(see 'mxgraph train --help')"),
    "inspect missing dump": (["inspect", "no_dump"],
                             "mxgraph: error: dump directory no_dump does not exist; write one "
                             "with Plan(dump_dir=...) or MXGRAPH_DUMP=DIR, then inspect it"),
    "inspect memory without model": (["inspect", "--memory"],
                                     "mxgraph: error: --memory needs --model NAME (a preset, "
                                     "e.g. llama2-70b)"),
    "inspect unknown pass": (["inspect", "dump", "--diff", "capture", "fuse"],
                             "mxgraph: error: no pass 'fuse' in dump; --diff takes two of: "
                             "00_capture, 01_dead_code (or the names after the NN_ prefix)"),
    "inspect unknown preset": (["inspect", "--comm", "--model", "gpt5"],
                               f"mxgraph: error: unknown model preset 'gpt5'; known presets: "
                               f"{PRESETS}"),
}
OTHER_RUNS = {"--debug": ["--debug", "train", "--plan", "tpp.toml"], "--help": ["--help"]}
# the same main() in this process (no interpreter start): variants of the paths above
IN_PROCESS = {
    "unknown moe field": (["train", "--plan", "moe.toml"],
                          "mxgraph: error: moe.toml: unknown plan field 'moe.capacty_factor'; "
                          "did you mean 'moe.capacity_factor'?"),
    "data file not 1-D ids": (["train", "--data", "matrix.npy"],
                              "mxgraph: error: matrix.npy: expected a 1-D integer array of "
                              "token ids, got shape (2, 2) dtype float64"),
    "plan not built": (["train", "--plan", "overlap.toml"],
                       "mxgraph: error: overlap: comm-compute overlap passes is not built yet "
                       "in this version of mxgraph; leave overlap at its default"),
    "unknown flag": (["train", "--num-steps", "2"],
                     "mxgraph train: error: unrecognized arguments: --num-steps 2 "
                     "(see 'mxgraph train --help')"),
    "no command": ([], "usage: mxgraph [-h] [--debug] {train,inspect} ...\n"
                       "mxgraph: error: the following arguments are required: command"),
}


def _write_inputs(directory: Path) -> None:
    np.save(directory / "matrix.npy", np.zeros((2, 2)))
    (directory / "junk.npy").write_bytes(b"not numpy")
    (directory / "text.txt").write_bytes(b"some bytes to train on, " * 8)
    for name, text in {"syntax": "tp == 2\n", "tpp": "tpp = 2\n", "two": 'tp = "two"\n',
                       "moe": "[moe]\ncapacty_factor = 1.0\n", "tp2": "tp = 2\n",
                       "overlap": "overlap = true\n"}.items():
        (directory / f"{name}.toml").write_text(text)
    (directory / "not_a_loss.py").write_text(NOT_A_LOSS)
    for entry in ("00_capture", "01_dead_code"):
        (directory / "dump" / entry).mkdir(parents=True)
    (directory / "dump" / "summary.txt").write_text("")


def _run(directory: Path, argv: list[str]) -> subprocess.CompletedProcess:
    entry = ["-m", "mxgraph.cli"]
    if argv[:1] == ["--not-a-loss"]:
        entry, argv = [str(directory / "not_a_loss.py")], argv[1:]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *entry, *argv], cwd=directory, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("cli")
    _write_inputs(directory)
    return directory


@pytest.fixture(scope="module")
def runs(inputs) -> dict[str, subprocess.CompletedProcess]:
    """Every command of USER_ERRORS and OTHER_RUNS, run at once."""
    commands = {name: argv for name, (argv, _) in USER_ERRORS.items()} | OTHER_RUNS
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        done = {name: pool.submit(_run, inputs, argv) for name, argv in commands.items()}
    return {name: future.result() for name, future in done.items()}


@pytest.mark.parametrize("name", USER_ERRORS)
def test_user_error_is_one_line_naming_the_fix(runs, name):
    run = runs[name]
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    assert run.stderr == USER_ERRORS[name][1] + "\n"
    assert run.stdout == ""  # nothing ran before the error


@pytest.mark.parametrize("name", IN_PROCESS)
def test_user_error_in_process(inputs, monkeypatch, capsys, name):
    from mxgraph.cli import main
    monkeypatch.chdir(inputs)
    try:
        status = main(IN_PROCESS[name][0])
    except SystemExit as exit:  # argparse's errors
        status = exit.code
    out, err = capsys.readouterr()
    assert (status, out, err) == (2, "", IN_PROCESS[name][1] + "\n")


def test_debug_shows_the_traceback(runs, inputs, monkeypatch, capsys):
    """`mxgraph --debug train ...` (a process) and `mxgraph train --debug ...` (here)."""
    from mxgraph.cli import main
    monkeypatch.chdir(inputs)
    status = main(["train", "--debug", "--plan", "tpp.toml"])
    for run in (runs["--debug"], subprocess.CompletedProcess([], status, "",
                                                            capsys.readouterr().err)):
        assert run.returncode == 2
        assert run.stderr.startswith("Traceback (most recent call last):")
        assert run.stderr.splitlines()[-1] == (
            "mxgraph.errors.PlanError: tpp.toml: unknown plan field 'tpp'; did you mean 'tp'?")


def test_help_lists_the_commands_there_are(runs):
    run = runs["--help"]
    assert run.returncode == 0 and run.stderr == ""
    assert run.stdout.startswith("usage: mxgraph [-h] [--debug] {train,inspect} ...\n")
    assert "Commands: train, inspect; 'mxgraph COMMAND --help' for one." in " ".join(
        run.stdout.split())
    assert "--debug" in run.stdout and "search" not in run.stdout and "bench" not in run.stdout


def test_a_bug_keeps_its_traceback(monkeypatch):
    """Only user errors are shortened: anything else propagates (exit 1 with the
    traceback from the interpreter)."""
    import mxgraph.train
    from mxgraph.cli import main

    def broken(cfg, progress):
        raise ZeroDivisionError("a bug")
    monkeypatch.setattr(mxgraph.train, "train", broken)
    with pytest.raises(ZeroDivisionError, match="a bug"):
        main(["train", "--steps", "1"])
