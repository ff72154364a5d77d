import sys

from ark.cli import main

sys.exit(main())
