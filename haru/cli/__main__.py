import sys

from haru.cli import main

sys.exit(main())
