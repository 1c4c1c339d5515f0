"""The HTML report in a real browser: headless Chromium (Debian's `chromium`) screenshots the fixture report through
scripts/screenshot_report.sh (network routed to a dead proxy). Skips, saying why, where no Chromium is installed
(.ci/run installs it when apt-get can)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


@pytest.mark.skipif(BROWSER is None, reason="no chromium on PATH (apt-get install -y chromium); the report's HTML "
                                            "is still checked for self-containment by test_report.py")
def test_report_screenshot(built_report, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg
    import numpy as np

    png = tmp_path / "report.png"
    r = subprocess.run(["bash", str(REPO / "scripts" / "screenshot_report.sh"), str(built_report["html"]), str(png),
                        "1200", "3000"], check=False, capture_output=True, text=True, timeout=120,
                       env={"CHROMIUM": BROWSER, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    img = mpimg.imread(str(png))  # (height, width, channels) floats in [0, 1]
    assert img.shape[:2] == (3000, 1200)
    gray = img[..., :3].mean(axis=2)
    # rendered, not blank: dark text pixels and the coloured headline box near the top, plots further down
    assert (gray[:300] < 0.3).mean() > 0.002
    rows_with_ink = (gray < 0.6).any(axis=1)
    assert rows_with_ink[:2500].mean() > 0.3
    # the embedded plots decode: saturated red novatune bars/lines somewhere on the page
    red = (img[..., 0] > 0.7) & (img[..., 1] < 0.35) & (img[..., 2] < 0.35)
    assert red.sum() > 500
    assert np.isfinite(gray).all()
