"""``python -m bench.tui --json`` runs end to end on the real app (a short run): its last
line is one JSON object with every figure, and every token and key it sent was matched
to a frame that showed it. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_tui_json_line():
    proc = subprocess.run([sys.executable, "-m", "bench.tui", "--json", "--starts", "1", "--turns", "2",
                           "--entries", "2000"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert any(ln.startswith("start_to_interactive_s") for ln in lines[:-1])  # the table
    for key in ("start_to_interactive_s", "key_latency_p95_ms", "token_lag_p95_ms", "inspector_10k_refresh_ms"):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["replies"] == 2 and result["tokens"] > 0 and result["keys"] > 0
    assert result["tokens_not_matched"] == 0 and result["keys_not_matched"] == 0
    assert result["inspector_rows_after_filter"] < 2000
