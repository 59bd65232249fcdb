"""A relay node never imports torch: it moves bytes and checks digests, so it starts fast and small."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_relay_modules_import_no_torch() -> None:
    got = _python("import sys\nimport zephon_stream.cli.relay, zephon_stream.relay\n"
                  "from zephon_stream.refit import versions, manifest, layout, codec\n"
                  "assert 'torch' not in sys.modules, 'torch was imported'\n")
    assert got.returncode == 0, got.stderr


def test_relay_help_and_an_idle_once_load_no_torch(tmp_path: Path) -> None:
    (tmp_path / "parent").mkdir()
    got = _python(
        "import runpy, sys\n"
        "from zephon_stream.cli.main import main\n"
        f"rc = main(['relay', '--from', 'file://{tmp_path}/parent/', '--to', 'file://{tmp_path}/child/', '--once'])\n"
        "assert rc == 0, rc\n"
        "sys.argv = ['zephon', 'relay', '--help']\n"
        "try:\n"
        "    runpy.run_module('zephon_stream.cli', run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n")
    assert got.returncode == 0, got.stderr
    assert "relayed 0 version(s)" in got.stdout and "--workers" in got.stdout
    cli = subprocess.run([sys.executable, "-m", "zephon_stream.cli", "relay", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "usage: zephon relay" in cli.stdout, cli.stderr


def test_refit_exports_load_on_first_use() -> None:
    got = _python("import sys\nimport zephon_stream.refit as refit\n"
                  "assert 'torch' not in sys.modules\n"
                  "assert sorted(refit.__all__) == sorted(refit._HOMES), 'every export has a home'\n"
                  "for name in refit.__all__:\n"
                  "    assert getattr(refit, name).__name__ == name, name\n"
                  "assert 'torch' in sys.modules\n")
    assert got.returncode == 0, got.stderr
