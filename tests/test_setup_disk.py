"""`make setup` warns before pip runs out of disk: the CI run of 2026-12-05 stopped 104 s in,
with pip's "No space left on device", on a disk that old clones had filled."""

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def disk_check(**variables):
    args = [f"{k}={v}" for k, v in variables.items()]
    done = subprocess.run(
        ["make", "-s", "--no-print-directory", "disk-check", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout + done.stderr


def test_a_disk_too_small_for_the_missing_venvs_is_named_with_both_figures(tmp_path):
    installed = tmp_path / "vllm.installed"
    installed.touch()
    out = disk_check(STAMP=tmp_path / "missing", VLLM_STAMP=installed, SETUP_GIB_VENV=10**9)
    assert out.startswith("WARNING: setup needs about 1000000000 GiB free for the venvs still to install")
    where = out.split(", and ")[1].split(" has ")[0]
    assert Path(where).resolve() == REPO
    assert "No space left on device" in out
    assert len(out.strip().splitlines()) == 1


def test_the_warning_counts_only_the_venvs_still_to_install(tmp_path):
    out = disk_check(STAMP=tmp_path / "a", VLLM_STAMP=tmp_path / "b", SETUP_GIB_VENV=10**9, SETUP_GIB_VLLM=7)
    assert "needs about 1000000007 GiB" in out


def test_installed_venvs_need_no_room(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).touch()
    out = disk_check(STAMP=tmp_path / "a", VLLM_STAMP=tmp_path / "b", SETUP_GIB_VENV=10**9)
    assert out == ""
