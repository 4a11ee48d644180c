import sys

from tta_core.cli import main

sys.exit(main())
