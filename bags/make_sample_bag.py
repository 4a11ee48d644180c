"""Make the sample bag of `tta demo`: bags/signs32_sample (rosbag2, MCAP, < 1 MB).

240 synthetic traffic-sign frames at 32 px and 30 Hz, 40 per domain: clean, then five
corruptions at severity 5, then clean again (a continual shift and a return). Idempotent:
an existing bag is kept unless --force.

    python bags/make_sample_bag.py [--force]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tta_core.cli import main  # noqa: E402

SAMPLE = HERE / "signs32_sample"
DOMAINS = "clean,gaussian_noise/5,motion_blur/5,fog/5,contrast/5,clean"


def make(force: bool = False) -> int:
    """Write the sample bag (or keep the existing one); exit status."""
    if SAMPLE.exists() and not force:
        print(f"{SAMPLE} exists (use --force to remake it)")
        return 0
    shutil.rmtree(SAMPLE, ignore_errors=True)
    return main(["make-bag", str(SAMPLE), "--frames", "240", "--image-size", "32",
                 "--domains", DOMAINS, "--seed", "2024", "--rate", "30"])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="remake an existing bag")
    sys.exit(make(ap.parse_args().force))
