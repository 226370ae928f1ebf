"""The CLI's user errors: one line `mxgraph: error: ...` naming the fix on stderr, status 2,
no traceback, nothing on stdout; `--debug` shows the traceback; `--help` lists the
commands that exist.

A process of `python -m mxgraph.cli` costs about 3 s of CPU (importing torch and mxgraph),
so the cases in PROCESSES (one per way out: a train error, a TraceError from compile, an
argparse error, an inspect error, --debug, --help) run as real processes, all at once; the
rest call the same `main()` here, stdout and stderr captured at the file descriptors."""
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
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

# name: (command line, the one line expected on stderr)
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
    "model returns no loss": (["not_a_loss.py", "train", "--data", "text.txt", "--steps", "1",
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
    "unknown moe field": (["train", "--plan", "moe.toml"],
                          "mxgraph: error: moe.toml: unknown plan field 'moe.capacty_factor'; "
                          "did you mean 'moe.capacity_factor'?"),
    "data file not 1-D ids": (["train", "--data", "matrix.npy"],
                              "mxgraph: error: matrix.npy: expected a 1-D integer array of "
                              "token ids, got shape (2, 2) dtype float64"),
    "impossible plan": (["train", "--plan", "batched.toml"],
                        "mxgraph: error: batched.toml: moe.batched_gemm=True needs moe.capacity_factor (a "
                        "batched GEMM needs every expert padded to the same row count); set "
                        "capacity_factor, e.g. 1.25, or turn batched_gemm off"),
    "unknown flag": (["train", "--num-steps", "2"],
                     "mxgraph train: error: unrecognized arguments: --num-steps 2 "
                     "(see 'mxgraph train --help')"),
}
PROCESSES = {"unknown plan field", "model returns no loss", "bad flag value",
             "inspect missing dump"}
OTHER_PROCESSES = {"--debug": ["--debug", "train", "--plan", "tpp.toml"], "--help": ["--help"]}


def _write_inputs(directory: Path) -> None:
    np.save(directory / "matrix.npy", np.zeros((2, 2)))
    (directory / "junk.npy").write_bytes(b"not numpy")
    (directory / "text.txt").write_bytes(b"some bytes to train on, " * 8)
    for name, text in {"syntax": "tp == 2\n", "tpp": "tpp = 2\n", "two": 'tp = "two"\n',
                       "moe": "[moe]\ncapacty_factor = 1.0\n", "tp2": "tp = 2\n",
                       "batched": "[moe]\nbatched_gemm = true\n"}.items():
        (directory / f"{name}.toml").write_text(text)
    (directory / "not_a_loss.py").write_text(NOT_A_LOSS)
    for entry in ("00_capture", "01_dead_code"):
        (directory / "dump" / entry).mkdir(parents=True)
    (directory / "dump" / "summary.txt").write_text("")


def _run(directory: Path, argv: list[str]) -> subprocess.CompletedProcess:
    entry = ["-m", "mxgraph.cli"]
    if argv[0].endswith(".py"):  # a script that runs mxgraph.cli as __main__
        entry, argv = [str(directory / argv[0])], argv[1:]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *entry, *argv], cwd=directory, env=env,
                          capture_output=True, text=True, timeout=120)


def _in_process(argv: list[str], directory: Path, monkeypatch, capfd
                ) -> subprocess.CompletedProcess:
    """`main(argv)` as the entry point calls it, run in `directory`."""
    from mxgraph.cli.main import main
    monkeypatch.chdir(directory)
    try:
        status = main(argv)
    except SystemExit as exit:  # argparse's errors
        status = exit.code
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(argv, status, out, err)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("cli")
    _write_inputs(directory)
    return directory


@pytest.fixture(scope="module")
def runs(inputs) -> dict[str, subprocess.CompletedProcess]:
    """The commands of PROCESSES and OTHER_PROCESSES, run at once."""
    commands = {name: USER_ERRORS[name][0] for name in PROCESSES} | OTHER_PROCESSES
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        done = {name: pool.submit(_run, inputs, argv) for name, argv in commands.items()}
    return {name: future.result() for name, future in done.items()}


@pytest.mark.parametrize("name", USER_ERRORS)
def test_user_error_is_one_line_naming_the_fix(name, request, inputs, monkeypatch, capfd):
    argv, expected = USER_ERRORS[name]
    if name in PROCESSES:
        run = request.getfixturevalue("runs")[name]
    else:
        run = _in_process(argv, inputs, monkeypatch, capfd)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    assert run.stderr == expected + "\n"
    assert run.stdout == ""  # nothing ran before the error


def test_debug_shows_the_traceback(runs, inputs, monkeypatch, capfd):
    """`mxgraph --debug train ...` (a process) and `mxgraph train --debug ...` (here)."""
    here = _in_process(["train", "--debug", "--plan", "tpp.toml"], inputs, monkeypatch, capfd)
    for run in (runs["--debug"], here):
        assert run.returncode == 2
        assert run.stderr.startswith("Traceback (most recent call last):")
        assert run.stderr.splitlines()[-1] == (
            "mxgraph.errors.PlanError: tpp.toml: unknown plan field 'tpp'; did you mean 'tp'?")


def test_help_lists_the_commands_there_are(runs):
    run = runs["--help"]
    assert run.returncode == 0 and run.stderr == ""
    assert run.stdout.startswith("usage: mxgraph [-h] [--debug] {train,inspect,search,export,data} ...\n")
    assert "Commands: train, inspect, search, export, data; 'mxgraph COMMAND --help' for one." in " ".join(
        run.stdout.split())
    assert "--debug" in run.stdout and "bench" not in run.stdout


def test_no_command_prints_the_usage(inputs, monkeypatch, capfd):
    run = _in_process([], inputs, monkeypatch, capfd)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == ("usage: mxgraph [-h] [--debug] {train,inspect,search,export,data} ...\n"
                          "mxgraph: error: the following arguments are required: command\n")


def test_a_bug_keeps_its_traceback(monkeypatch):
    """Only user errors are shortened: anything else propagates (exit 1 with the
    traceback from the interpreter)."""
    import mxgraph.train.loop
    from mxgraph.cli.main import main

    def broken(cfg, progress):
        raise ZeroDivisionError("a bug")
    monkeypatch.setattr(mxgraph.train.loop, "train", broken)
    with pytest.raises(ZeroDivisionError, match="a bug"):
        main(["train", "--steps", "1"])
