import sys

from dsv4.cli import main

sys.exit(main())
