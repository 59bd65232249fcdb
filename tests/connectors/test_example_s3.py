"""examples/stream_from_s3.py runs end to end: SeaweedFS, upload, a few training steps from S3."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "stream_from_s3.py"


@pytest.mark.slow
def test_stream_from_s3_example(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "4", "--data", str(tmp_path / "demo"),
                          "--min-mb", "0.3", "--stdlib-only"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "uploaded" in out.stdout
    steps = re.findall(r"^step +(\d+) .* S3: (\d+) requests, ([\d,]+) bytes", out.stdout, re.M)
    assert [int(s) for s, _, _ in steps] == [1, 4]
    assert all(int(req) > 0 and int(b.replace(",", "")) > 0 for _, req, b in steps)  # read from S3
    assert re.search(r"loss [\d.]+ -> [\d.]+ over 4 steps", out.stdout)
