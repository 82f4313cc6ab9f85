import sys

from decentrl.cli import main

sys.exit(main())
