"""The `strata` package as pip installs it: `meson install` and the wheel
carry every module of the package (bindings/python/meson.build lists them
one by one), and a wheel built from pyproject.toml (meson-python) installs
into a fresh virtual environment, finds the library inside the package and
trains through strata.torch with nothing of the source tree in reach.

The wheel test builds libstrata from scratch (minutes on two cores): it runs
where STRATA_TEST_WHEEL=1 (scripts/test.sh --full sets it) and skips
elsewhere."""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bindings" / "python"


def test_meson_installs_every_module_of_the_package():
    listed = set(re.findall(r"'(strata/[^']+\.py)'", (PACKAGE / "meson.build").read_text()))
    modules = {p.relative_to(PACKAGE).as_posix() for p in (PACKAGE / "strata").rglob("*.py")}
    assert modules - listed == set(), "bindings/python/meson.build does not install these"
    assert listed - modules == set(), "bindings/python/meson.build names modules that do not exist"


def test_pyproject_builds_through_meson_python():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'build-backend = "mesonpy"' in text
    assert "-Dpython_wheel=true" in text
    # The version is meson.build's (dynamic), one number for the library, the C header and the wheel.
    assert 'dynamic = ["version"]' in text


LOOP = textwrap.dedent("""
    import json, os, sys, torch
    import strata, strata.torch
    here = os.path.dirname(strata.__file__)
    assert strata.library_path().startswith(here), (strata.library_path(), here)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    cfg = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
           "strata": {"device": "host"}}
    engine = strata.torch.initialize(model, cfg)
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    losses = []
    for _ in range(20):
        loss = torch.nn.functional.mse_loss(model(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    print(json.dumps({"library": strata.library_path(), "version": strata.version(), "losses": losses}))
""")


@pytest.mark.skipif(os.environ.get("STRATA_TEST_WHEEL") != "1",
                    reason="builds libstrata from scratch (minutes): STRATA_TEST_WHEEL=1, as scripts/test.sh --full")
def test_wheel_installs_into_a_fresh_venv_and_trains(tmp_path):
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    for module in ("mesonpy", "build", "venv", "torch"):
        if subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode != 0:
            pytest.fail(f"{python} lacks {module}: scripts/install-deps.sh installs python3-mesonpy, python3-build, "
                        "python3-venv and python3-torch")
    # A copy of the source tree, so that nothing the build writes lands in the checkout.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build*", "__pycache__", ".debs", ".venv",
                                                             ".mesonpy*", "strata_swap"))
    dist = tmp_path / "dist"
    # Compiled without optimisation (-O0: about half the compile time of the release build pip makes by
    # default): what this test checks is what the wheel holds and that it installs and trains, not its speed.
    built = subprocess.run([python, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist),
                            "-Csetup-args=-Dcuda=disabled", "-Csetup-args=-Dbuildtype=plain",
                            "-Csetup-args=-Dcpp_args=-O0", "-Csetup-args=-Dc_args=-O0", str(src)],
                           cwd=tmp_path, capture_output=True, text=True)
    assert built.returncode == 0, (built.stdout + built.stderr)[-4000:]
    wheels = list(dist.glob("strata-*.whl"))
    assert len(wheels) == 1, wheels
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-index", "--no-deps", "--quiet"]
    subprocess.run(pip + [str(wheels[0])], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("STRATA_LIBRARY", "PYTHONPATH")}
    run = subprocess.run([str(venv / "bin" / "python"), "-c", LOOP], cwd=tmp_path, env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["library"].startswith(str(venv)), out["library"]
    assert out["losses"][-1] < 0.8 * out["losses"][0], out["losses"]
    # The `strata` command comes with it.
    cli = subprocess.run([str(venv / "bin" / "strata"), "--help"], capture_output=True, text=True, env=env)
    assert cli.returncode == 0 and "plan" in cli.stdout, cli.stdout + cli.stderr
