import sys

from mooncaked.daemon.main import main

sys.exit(main())
