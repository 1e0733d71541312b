import sys

from kafkatx.cli import main

sys.exit(main())
